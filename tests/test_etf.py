"""Fixed neural-collapse classifiers: the simplex ETF and FedLoGe's SSE-C (Eq. 2-5, Table 6)."""

from __future__ import annotations

import pytest
import torch

from fedlt.models.etf import build_sse_c, classifier_geometry, etf_angle, simplex_etf, sparsity_mask, sse_c_loss


def test_simplex_etf_has_equal_norms_and_the_maximal_equal_angle():
    etf = simplex_etf(64, 10, torch.Generator().manual_seed(0))
    geo = classifier_geometry(etf)
    assert etf.shape == (10, 64)
    assert geo["norm_mean"] == pytest.approx(1.0, abs=1e-6) and geo["norm_var"] < 1e-12
    assert geo["angle_min"] == pytest.approx(etf_angle(10), abs=1e-4)  # arccos(-1/9) = 96.38 deg
    assert geo["angle_mean"] == pytest.approx(etf_angle(10), abs=1e-4)
    assert torch.allclose(etf.sum(0), torch.zeros(64), atol=1e-5)  # centred: the columns sum to zero
    with pytest.raises(ValueError, match="feature_dim >= num_classes"):
        simplex_etf(5, 10, torch.Generator())


def test_sparsity_mask_zeroes_exactly_the_requested_fraction():
    mask = sparsity_mask((10, 128), 0.6, torch.Generator().manual_seed(1))
    assert int((mask == 0).sum()) == 768 and set(mask.unique().tolist()) == {0.0, 1.0}
    other = sparsity_mask((10, 128), 0.6, torch.Generator().manual_seed(2))
    assert not torch.equal(mask, other)
    with pytest.raises(ValueError, match="sparsity"):
        sparsity_mask((3, 3), 1.0, torch.Generator())


@pytest.mark.parametrize("sparsity,gamma", [(0.6, 1.0), (0.4, 0.5)])
def test_sse_c_is_sparse_equal_norm_and_nearly_equiangular(sparsity, gamma):
    """Table 6: the optimised sparse matrix keeps its zeros, reaches the target norm with variance
    far below 1e-6 and a minimum angle within half a degree of the dense ETF's."""
    gen = torch.Generator().manual_seed(0)
    weight, mask = build_sse_c(128, 10, sparsity=sparsity, gamma=gamma, steps=2000, lr=1e-3, generator=gen)
    zeros = round(sparsity * 1280)
    assert int((mask == 0).sum()) == zeros
    assert torch.all(weight[mask == 0] == 0) and int((weight == 0).sum()) == zeros
    geo = classifier_geometry(weight)
    assert geo["norm_mean"] == pytest.approx(gamma, abs=1e-3)
    assert geo["norm_var"] < 1e-6
    assert geo["angle_min"] > etf_angle(10) - 0.5
    # the optimisation is what restores the geometry: masking the ETF alone breaks it
    masked, _ = build_sse_c(128, 10, sparsity=sparsity, gamma=gamma, steps=0, lr=1e-3,
                            generator=torch.Generator().manual_seed(0))
    raw = classifier_geometry(masked)
    assert raw["norm_var"] > 1e-4 and raw["angle_min"] < etf_angle(10) - 3
    assert sse_c_loss(weight, mask, gamma) < sse_c_loss(masked, mask, gamma)


def test_sse_c_is_seeded():
    a, _ = build_sse_c(32, 5, sparsity=0.5, gamma=1.0, steps=20, lr=1e-3, generator=torch.Generator().manual_seed(3))
    b, _ = build_sse_c(32, 5, sparsity=0.5, gamma=1.0, steps=20, lr=1e-3, generator=torch.Generator().manual_seed(3))
    c, _ = build_sse_c(32, 5, sparsity=0.5, gamma=1.0, steps=20, lr=1e-3, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_too_narrow_a_model_is_a_config_error():
    from fedlt.errors import ConfigError
    from fedlt.models.etf import check_etf_width

    check_etf_width(64, 10, "resnet32")
    with pytest.raises(ConfigError, match=r"feature width >= 100; model resnet32 has 64: choose a model at least "
                                          r"that wide \(`fedlt models` gives each one's feature width\)$"):
        check_etf_width(64, 100, "resnet32")
