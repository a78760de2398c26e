"""The fused state copies and sums (fedlt.fused) are the one-by-one loops' arithmetic, bit for bit,
whatever mix of dtypes and memory formats a model's state holds."""

from __future__ import annotations

import torch

from fedlt import fused


def state() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 3, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)
    return [conv, torch.randn(7, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g),
            torch.tensor(3), torch.randn(2, 2, generator=g).t()]  # an int buffer, a transposed view


def test_clones_are_detached_copies_in_each_tensors_dtype_and_memory_format():
    tensors = state()
    tensors[2].requires_grad_(True)
    copies = fused.clones(tensors)
    for t, c in zip(tensors, copies):
        assert torch.equal(c, t.detach()) and c.dtype == t.dtype and c.stride() == t.detach().clone().stride()
        assert c.data_ptr() != t.data_ptr() and not c.requires_grad
    copies[0].zero_()
    assert tensors[0].abs().sum() > 0  # a copy, not a view


def test_clones_keep_every_bit_of_special_values_in_every_dtype():
    """The copies made by multiplying by 1 keep -0.0, infinities and subnormals bit for bit and a NaN a
    NaN (its payload is the arithmetic's: bfloat16 makes it canonical); bool and complex tensors, for
    which 1 is no identity factor, are copied as they are."""
    specials = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.5])
    tensors = [specials, specials.double(), specials.half(), specials.bfloat16(), torch.tensor([-128, 127], dtype=torch.int8),
               torch.tensor([2 ** 62 + 1]), torch.tensor([True, False]), torch.tensor([complex(float("inf"), 1.0), -0.0j])]
    for t, c in zip(tensors, fused.clones(tensors)):
        assert c.dtype == t.dtype and c.data_ptr() != t.data_ptr()
        numbers = ~t.isnan()
        assert torch.equal(c.isnan(), ~numbers) and torch.equal(c[numbers].view(torch.uint8), t[numbers].view(torch.uint8))


def test_float8_states_are_copied_too():
    """float8 has no multiplication kernel on the CPU: its group is copied, not multiplied."""
    t = torch.tensor([-0.0, 1.5, -448.0, 2.0 ** -9]).to(torch.float8_e4m3fn)
    (c,) = fused.clones([t])
    assert c.dtype == t.dtype and torch.equal(c.view(torch.uint8), t.view(torch.uint8))


def test_clones_dispatch_one_operation_per_group_not_an_allocation_per_tensor():
    """A model's state (here 12 float tensors and an int buffer) is copied by one fused call per
    dtype: on a GPU the host's cost of a client's message and reply."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    tensors = [torch.randn(3, 4) for _ in range(12)] + [torch.tensor(3)]
    with Dispatched() as dispatched:
        fused.clones(tensors)
    assert dispatched.names == ["aten._foreach_mul.Scalar"] * 2


def test_copy_writes_in_place_into_parameters_without_history():
    destinations = [torch.nn.Parameter(torch.zeros(5, 2)), torch.zeros(7, dtype=torch.float64)]
    sources = [state()[2], state()[1]]
    pointers = [d.data_ptr() for d in destinations]
    fused.copy_(destinations, sources)
    assert all(torch.equal(d, s) for d, s in zip(destinations, sources))
    assert [d.data_ptr() for d in destinations] == pointers and destinations[0].grad_fn is None


def test_scaled_and_add_equal_the_loop_to_the_last_bit():
    tensors = [t.double() if not t.is_floating_point() else t for t in state()]
    products = fused.scaled(tensors, 37)
    assert all(torch.equal(p, t * 37) and p.dtype == t.dtype for p, t in zip(products, tensors))
    totals, expected = [p.clone() for p in products], [p.clone() for p in products]
    fused.add_(totals, tensors)
    for e, t in zip(expected, tensors):
        e += t
    assert all(torch.equal(a, b) for a, b in zip(totals, expected))
    # one fused call per dtype (and device), in order of first appearance; pairs group by both
    assert fused.groups(tensors) == [[0, 2, 4], [1, 3]]
    assert fused.groups(tensors, [t.float() for t in tensors]) == [[0, 2, 4], [1, 3]]
    assert fused.groups(tensors[:2], [tensors[0], tensors[0]]) == [[0], [1]]
    assert fused.groups(tensors, [t.clone() for t in tensors]) == [[0, 2, 4], [1, 3]]  # pairs that agree
    assert fused.groups([tensors[0], torch.zeros(2, device="meta"), tensors[2]]) == [[0, 2], [1]]  # by device
    assert fused.groups([], []) == []


def test_packed_clones_lay_each_dense_group_in_one_buffer_and_copy_every_bit():
    """A state handed to another stream is copied into one new buffer per device and dtype (one
    allocation and one stream mark, not one per tensor): each copy a view of it with the original's
    shape and strides (channels-last kept), starting on a 16-byte boundary, every bit equal; tensors
    that fill no span of memory alone (a transposed slice) and lone members are copied by ``clones``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        made: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.empty.memory_format, torch.ops.aten._foreach_mul.Scalar):
                self.made.append(str(func))
            return out

    specials = torch.tensor([-0.0, float("nan"), float("inf"), 1e-45, 3.5])
    tensors = [*state(), specials, torch.tensor([5, -6]), torch.randn(6, 4)[::2].t(), torch.randn(3, 1, 1, 1)]
    with Allocations() as allocations:
        copies, buffers = fused.packed_clones(tensors)
    # float32 (a buffer, the transposed and the sliced tensor copied alone), float64 (one tensor), int64
    assert allocations.made == ["aten.empty.memory_format", "aten._foreach_mul.Scalar", "aten._foreach_mul.Scalar",
                                "aten.empty.memory_format"]
    float_buffer = buffers[0]
    for t, c in zip(tensors, copies):
        numbers = ~t.isnan()
        assert c.dtype == t.dtype and c.shape == t.shape and c.stride() == t.clone().stride()
        assert torch.equal(c.isnan(), ~numbers) and torch.equal(c[numbers], t[numbers])
        assert torch.equal(c[numbers].view(torch.uint8), t[numbers].view(torch.uint8)) if t.dim() else True
        assert c.data_ptr() != t.data_ptr() and c.data_ptr() % 16 == 0 and not c.requires_grad
    in_float_buffer = [c.untyped_storage().data_ptr() == float_buffer.untyped_storage().data_ptr() for c in copies]
    assert in_float_buffer == [True, False, True, False, False, True, False, False, True]
    assert copies[0].is_contiguous(memory_format=torch.channels_last)
    assert all(any(c.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
               for c in copies)  # every copy lies in a buffer handed back
    copies[0].zero_()
    assert tensors[0].abs().sum() > 0 and torch.equal(copies[2], tensors[2])  # copies, apart from each other
