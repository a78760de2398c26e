"""Secure aggregation: SecAgg+ (Bell et al., CCS 2020) for the phases a method only ever sums.

A method's server names the exchanges whose replies it reduces linearly — summed (``sum``) or
averaged by sample count (``weighted_mean``): FedAvg's update, SFD's statistics — in
:meth:`Server.secure_phases <fedlt.methods.base.Server.secure_phases>`. With ``secagg.enabled``
the engine runs each such phase as four exchanges with the same clients, and the method receives
one reply holding the aggregate (under the id :data:`AGGREGATE`), never a client's own:

1. ``secagg:keys``: every client makes two ECDH key pairs (one encrypts shares, one agrees
   pairwise masks) and a self-mask seed, and sends the public keys.
2. ``secagg:shares``: each client gets its neighbours' public keys, Shamir-shares its seed and its
   mask key (threshold t) and sends one share pair per neighbour, encrypted for that neighbour.
3. the phase itself: a client answers as usual, but uploads its reply only as one fixed-point
   vector (resolution 2^-fraction_bits) plus its self mask and its pairwise masks, mod 2^64.
4. ``secagg:unmask``: the clients still there send, per neighbour, a share of the seed of one
   that uploaded or of the mask key of one that dropped out; the server removes every mask.

The primitives are Flower's SecAgg+ ones (ECDH key agreement with HKDF, Fernet encryption, Shamir
sharing); the masks are AES-256-CTR keystreams (Flower's own mask generator seeds numpy's
Mersenne Twister with 32 bits). Flower's ``SecAggPlusWorkflow`` cannot run fedlt's phases: in
flwr 1.41 it needs a ``LegacyContext`` and masks only a legacy strategy's parameter list.
"""

from __future__ import annotations

import base64
import json
import math
import os
import zlib
from typing import Any, Callable

import numpy as np
import torch

from fedlt.config import SecAggConfig
from fedlt.errors import ConfigError, FedltError
from fedlt.messages import Message, Reply
from fedlt.seeding import numpy_rng

#: the id of the single reply a method receives for a secure phase
AGGREGATE = -1
MODES = ("sum", "weighted_mean")
KEYS, SHARES, UNMASK = "secagg:keys", "secagg:shares", "secagg:unmask"
#: the message payload entry that turns a phase secure; the ctx.state entry of a client's secrets
ENTRY = "secagg"


class TooFewForSecureSum(FedltError):
    """Dropouts left a secure phase without enough clients to sum without revealing one of them: the
    phase is not aggregated (a caller that can go without it, such as an evaluation, may carry on)."""


Exchange = Callable[[str, int, list[tuple[int, Message]]], dict[int, Reply]]


def flower_crypto():
    try:
        from flwr.common.secure_aggregation.crypto import shamir, symmetric_encryption
        from flwr.supercore.primitives import asymmetric
    except ImportError:
        raise ConfigError("secagg.enabled needs Flower's SecAgg+ primitives: pip install 'fedlt[flower]'") from None
    return shamir, symmetric_encryption, asymmetric


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())


def _mask(seed: bytes, length: int) -> np.ndarray:
    """``length`` uint64 words of the AES-256-CTR keystream under the 32-byte ``seed``."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(8 * length))
    return np.frombuffer(stream, dtype=np.uint64)


def _agree(private_pem: str, public_pem: str) -> bytes:
    """The urlsafe-base64 32-byte key two parties derive from one's private and the other's public key."""
    _, sym, asym = flower_crypto()
    return sym.generate_shared_key(asym.bytes_to_private_key(private_pem.encode()),
                                   asym.bytes_to_public_key(public_pem.encode()))


def _pair_mask(private_pem: str, public_pem: str, length: int) -> np.ndarray:
    return _mask(base64.urlsafe_b64decode(_agree(private_pem, public_pem)), length)


# ---- replies as vectors ---------------------------------------------------------------------
def _entry_at(schema: list[list[Any]], index: int) -> list[Any]:
    """The schema entry (section, key, shape, kind) that holds position ``index`` of the flat vector."""
    at = 0
    for entry in schema:
        at += int(np.prod(entry[2], dtype=np.int64))
        if index < at:
            return entry
    return ["", "num_samples", [], "int"]


def flatten(reply: Reply, mode: str) -> tuple[list[list[Any]], np.ndarray]:
    """A reply's weights, payload and metrics as one float64 vector (times ``num_samples`` for
    ``weighted_mean``; a client without samples contributes zeros), ``num_samples`` last; and the
    layout that :func:`unflatten` needs."""
    schema, parts = [], []
    for section in ("weights", "payload", "metrics"):
        entries = getattr(reply, section)
        for key in sorted(entries, key=str):
            value = entries[key]
            if isinstance(value, torch.Tensor):
                arr, kind = value.detach().cpu().to(torch.float64).numpy(), str(value.dtype)
            elif isinstance(value, (bool, int, float, np.bool_, np.number)):
                kind = ("bool" if isinstance(value, (bool, np.bool_)) else
                        "int" if isinstance(value, (int, np.integer)) else "float")
                arr = np.asarray(float(value))
            else:
                raise FedltError(f"secure aggregation sums tensors and numbers, but reply {section} entry '{key}' is "
                                 f"a {type(value).__name__}; set secagg.enabled=false for this method")
            schema.append([section, key, list(arr.shape), kind])
            parts.append(arr.reshape(-1))
    values = np.concatenate([*parts, np.zeros(1)])
    n = reply.num_samples
    if mode == "weighted_mean":
        values = values * n if n > 0 else np.zeros_like(values)
    values[-1] = n
    return schema, values


def add_reply(total: Reply | None, reply: Reply, kind: str) -> Reply:
    """``total`` plus ``reply``, entry by entry, in place (``total`` None: a copy of ``reply``, so no
    client's tensor is changed): the aggregate of a phase summed in the clear, in the order the replies
    come, which is how its server summed them one by one. Entries of other shapes are refused, as secure
    aggregation refuses them, rather than broadcast into a wrong sum."""
    for section in ("weights", "payload", "metrics"):
        for key, value in getattr(reply, section).items():
            if not isinstance(value, (torch.Tensor, bool, int, float, np.bool_, np.number)):
                raise FedltError(f"{kind}: reply {section} entry '{key}' is a {type(value).__name__}, which cannot be "
                                 "summed; a phase its server declares summed (Server.secure_phases) holds tensors "
                                 "and numbers")
    if total is None:
        copy = lambda entries: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}  # noqa: E731
        return Reply(weights=copy(reply.weights), num_samples=reply.num_samples, payload=copy(reply.payload),
                     metrics=copy(reply.metrics))
    for section in ("weights", "payload", "metrics"):
        into, entries = getattr(total, section), getattr(reply, section)
        if into.keys() != entries.keys():
            raise FedltError(f"{kind}: the clients' replies differ in {section} entries ({sorted(into, key=str)} vs "
                             f"{sorted(entries, key=str)}); a phase its server declares summed needs one layout")
        for key, value in entries.items():
            held = into[key]
            if (shape := list(np.shape(held))) != list(np.shape(value)):
                raise FedltError(f"{kind}: the clients' replies differ in the shape of {section} entry '{key}' "
                                 f"({shape} vs {list(np.shape(value))}); a phase its server declares summed needs "
                                 "one layout")
            if isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and \
                    (value.dtype, value.device) == (held.dtype, held.device):
                held += value
            elif isinstance(held, (bool, np.bool_)) and isinstance(value, (bool, np.bool_)):
                into[key] = bool(held or value)  # as a bool tensor sums, and a secure sum reads back
            else:
                into[key] = held + value
    total.num_samples += reply.num_samples
    return total


def summed_entries(reply: Reply) -> list[str] | None:
    """What a masked upload holds, from its layout: each entry as ``section/key [shape]``, then the
    ``num_samples`` that :func:`flatten` appends (the ledger's view of a secure phase); None for a
    reply that is not a masked upload."""
    if set(reply.payload) != {"masked", "schema"} or not isinstance(reply.payload["schema"], str):
        return None
    return [*(f"{section}/{key} {shape}" for section, key, shape, _ in json.loads(reply.payload["schema"])),
            "num_samples []"]


def unflatten(schema: list[list[Any]], values: np.ndarray, mode: str, device: torch.device) -> Reply:
    """The aggregate reply: sums, or sample-weighted means with the summed ``num_samples``."""
    n = int(round(values[-1]))
    if mode == "weighted_mean":
        if n <= 0:
            return Reply(num_samples=0)
        values = values / n
    reply, offset = Reply(num_samples=n), 0
    for section, key, shape, kind in schema:
        size = math.prod(shape)
        arr = values[offset:offset + size].reshape(shape)
        offset += size
        if kind.startswith("torch."):
            dtype = getattr(torch, kind.removeprefix("torch."))
            tensor = torch.from_numpy(arr.copy())
            value: Any = (tensor if dtype.is_floating_point else tensor.round()).to(dtype=dtype, device=device)
        else:
            value = {"bool": lambda v: bool(round(v)), "int": lambda v: int(round(v)), "float": float}[kind](float(arr))
        getattr(reply, section)[key] = value
    return reply


# ---- client side ----------------------------------------------------------------------------
def client_step(kind: str, cid: int, msg: Message, state: dict[str, Any]) -> Reply:
    """Stages 1, 2 and 4 on a client; its secrets live in ``state[ENTRY]`` until unmasking."""
    shamir, sym, asym = flower_crypto()
    if kind == KEYS:
        (sk_c, pk_c), (sk_s, pk_s) = asym.generate_key_pairs(), asym.generate_key_pairs()
        state[ENTRY] = {"sk_c": asym.private_key_to_bytes(sk_c).decode(), "sk_s": asym.private_key_to_bytes(sk_s).decode(),
                        "seed": _b64(os.urandom(32))}
        return Reply(payload={"pk_c": asym.public_key_to_bytes(pk_c).decode(),
                              "pk_s": asym.public_key_to_bytes(pk_s).decode()})
    own = state.get(ENTRY)
    if own is None:
        raise FedltError(f"secure aggregation: client {cid} got '{kind}' without its keys (stage 1 missing)")
    if kind == SHARES:
        group, t = msg.payload["group"], int(msg.payload["t"])
        ids = sorted(group)
        if cid not in group or len(ids) < 2 or not 2 <= t <= len(ids):
            raise FedltError(f"secure aggregation: client {cid} refuses to share its keys with group {ids} at "
                             f"threshold {t} (needs itself, another client and 2 <= t <= group size)")
        own["t"] = t
        seed_shares = shamir.create_shares(_unb64(own["seed"]), t, len(ids))
        key_shares = shamir.create_shares(own["sk_s"].encode(), t, len(ids))
        own["pk_c"] = {j: group[j][0] for j in ids}
        own["pk_s"] = {j: group[j][1] for j in ids}
        cts = {j: sym.encrypt(_agree(own["sk_c"], own["pk_c"][j]), json.dumps(
                   [cid, j, _b64(s), _b64(k)]).encode()).decode()
               for j, s, k in zip(ids, seed_shares, key_shares)}
        return Reply(payload={"cts": cts})
    if kind == UNMASK:
        state.pop(ENTRY)
        alive, dropped = set(msg.payload["alive"]), set(msg.payload["dropped"])
        if alive & dropped:
            raise FedltError(f"secure aggregation: client {cid} was asked for both secrets of clients {sorted(alive & dropped)}")
        if not own.get("uploaded") or len(alive) < own["t"]:
            raise FedltError(f"secure aggregation: client {cid} refuses to unmask: it uploaded nothing under these keys "
                             f"or fewer than t={own['t']} of its neighbours did")
        seed_shares, key_shares = {}, {}
        for src, ct in own.get("cts", {}).items():
            if src not in alive and src not in dropped:
                continue
            frm, to, seed_share, key_share = json.loads(sym.decrypt(_agree(own["sk_c"], own["pk_c"][src]), ct.encode()))
            if (frm, to) != (src, cid):
                raise FedltError(f"secure aggregation: client {cid} holds a share from {frm} to {to} under {src}'s key")
            if src in alive:
                seed_shares[src] = seed_share
            else:
                key_shares[src] = key_share
        return Reply(payload={"seed_shares": seed_shares, "key_shares": key_shares})
    raise ValueError(f"unknown secure aggregation stage '{kind}'")


def mask_reply(cid: int, reply: Reply, spec: dict[str, Any], state: dict[str, Any]) -> Reply:
    """Stage 3 on a client: its reply as a masked fixed-point vector, the only thing uploaded."""
    own = state.get(ENTRY)
    if own is None or "pk_s" not in own:
        raise FedltError(f"secure aggregation: client {cid} got a masked phase before sharing its keys")
    if own.get("uploaded") or len(spec["cts"]) < own["t"] or cid not in spec["cts"]:
        raise FedltError(f"secure aggregation: client {cid} refuses to upload: it already did under these keys, or "
                         f"fewer than t={own['t']} of its group shared their keys")
    own["cts"], own["uploaded"] = dict(spec["cts"]), True
    schema, values = flatten(reply, spec["mode"])
    bits, clients = int(spec["bits"]), int(spec["clients"])
    limit = 2.0 ** (62 - bits) / clients
    finite = np.isfinite(values)
    if not finite.all():  # no fixed-point integer holds it: a NaN model, not a precision setting
        section, key, _, _ = _entry_at(schema, int(np.argmin(finite)))
        raise FedltError(f"secure aggregation: client {cid}'s reply {section} entry '{key}' is not finite "
                         f"({values[~finite][0]:g}), which no masked sum can carry: its local training diverged; "
                         "lower fl.lr or set fl.grad_clip (or the method's knob that drives it)")
    biggest = float(np.abs(values).max())
    if biggest >= limit:
        raise FedltError(f"secure aggregation: client {cid}'s reply holds {biggest:g}, beyond the {limit:g} that "
                         f"secagg.fraction_bits={bits} allows for {clients} clients; lower secagg.fraction_bits")
    masked = np.round(values * 2.0 ** bits).astype(np.int64).view(np.uint64)
    masked = masked + _mask(_unb64(own["seed"]), masked.size)
    for j in sorted(own["cts"]):
        if j != cid:
            pair = _pair_mask(own["sk_s"], own["pk_s"][j], masked.size)
            masked = masked + pair if cid < j else masked - pair
    return Reply(payload={"masked": masked, "schema": json.dumps(schema)})


# ---- server side ----------------------------------------------------------------------------
def neighbour_groups(ids: list[int], neighbours: int, rng: np.random.Generator) -> dict[int, list[int]]:
    """Each client's group (itself included): everyone (``neighbours`` 0 or >= len(ids)), or the
    ``neighbours`` nearest on a random ring, as in SecAgg+ (a symmetric relation)."""
    n = len(ids)
    if neighbours == 0 or neighbours >= n:
        return {c: list(ids) for c in ids}
    ring = [ids[i] for i in rng.permutation(n)]
    half = neighbours // 2
    return {c: sorted({ring[(i + o) % n] for o in range(-half, half + 1)}) for i, c in enumerate(ring)}


def connected(uploaders: set[int], groups: dict[int, list[int]]) -> bool:
    """Whether pairwise masks link every uploader to every other (through uploaders): otherwise
    unmasking reveals the sum of each linked part, not only the total."""
    start = min(uploaders)
    seen, todo = {start}, [start]
    while todo:
        for j in groups[todo.pop()]:
            if j in uploaders and j not in seen:
                seen.add(j)
                todo.append(j)
    return seen == uploaders


def threshold(cfg: SecAggConfig, group_size: int) -> int:
    return min(group_size, max(2, math.ceil(cfg.threshold * group_size)))


class SecureAggregation:
    """The server side of one run: which phases are secure, which travel in the clear."""

    def __init__(self, cfg: SecAggConfig, phases: dict[str, str], seed: int, device: torch.device):
        flower_crypto()
        bad = {k: m for k, m in phases.items() if m not in MODES}
        if bad:
            raise ValueError(f"secure phases need a mode in {MODES}, got {bad}")
        self.cfg, self.phases, self.seed, self.device = cfg, dict(phases), seed, device
        #: exchange kinds that were run without secure aggregation
        self.in_clear: set[str] = set()
        #: the secure phase being run, if any
        self.phase: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"enabled": self.cfg.enabled, "phases": self.phases, "in_clear": sorted(self.in_clear),
                "neighbours": self.cfg.neighbours, "threshold": self.cfg.threshold, "fraction_bits": self.cfg.fraction_bits,
                "masks": "AES-256-CTR", "key_agreement": "ECDH SECP384R1 + HKDF-SHA256 (flwr)",
                "secret_sharing": "Shamir (flwr)"}

    def exchange(self, send: Exchange, kind: str, rnd: int, items: list[tuple[int, Message]]) -> dict[int, Reply]:
        """Run ``kind`` for ``items`` through the four stages; ``send`` is the engine's plain exchange.
        While it runs, :attr:`phase` is ``kind``: the engine accounts its sub-exchanges as that phase."""
        self.phase = kind
        try:
            return self._exchange(send, kind, rnd, items)
        finally:
            self.phase = None

    def _exchange(self, send: Exchange, kind: str, rnd: int, items: list[tuple[int, Message]]) -> dict[int, Reply]:
        if not items:
            return {}
        if len(items) < 2:
            raise FedltError(f"round {rnd} ({kind}): secure aggregation needs at least 2 clients and this phase has "
                             f"{len(items)}; raise fl.participation or set secagg.enabled=false")
        keys = send(KEYS, rnd, [(cid, Message()) for cid, _ in items])
        if len(keys) < 2:
            raise TooFewForSecureSum(f"round {rnd} ({kind}): {len(keys)} client(s) answered the key exchange; "
                                     "secure aggregation needs at least 2 (a lone reply would be revealed)")
        rng = numpy_rng(self.seed, "secagg", rnd, zlib.crc32(kind.encode()))
        groups = neighbour_groups(sorted(keys), self.cfg.neighbours, rng)
        t = threshold(self.cfg, len(next(iter(groups.values())))) if groups else 2
        shares = send(SHARES, rnd, [(c, Message(payload={"t": t, "group": {
            j: [keys[j].payload["pk_c"], keys[j].payload["pk_s"]] for j in groups[c]}})) for c in sorted(groups)])
        inbox: dict[int, dict[int, str]] = {c: {} for c in shares}
        for src, reply in shares.items():
            for dst, ct in reply.payload["cts"].items():
                if dst in inbox:
                    inbox[dst][src] = ct
        mode = self.phases[kind]
        spec = {"mode": mode, "bits": self.cfg.fraction_bits, "clients": len(shares)}
        masked = send(kind, rnd, [(cid, Message(msg.weights, {**msg.payload, ENTRY: {**spec, "cts": inbox[cid]}}))
                                  for cid, msg in items if cid in shares])
        if not masked:
            return {}
        if not connected(set(masked), groups):
            raise TooFewForSecureSum(f"round {rnd} ({kind}): dropouts split the clients that uploaded into groups "
                                     "with no mask between them, so unmasking would reveal each group's sum; the phase "
                                     "is not aggregated (raise secagg.neighbours, or 0 for every pair)")
        for owner in sorted(shares):  # each secret needs t share holders among the uploaders
            holders = sum(j in masked for j in groups[owner])
            if holders < t:
                raise TooFewForSecureSum(f"round {rnd} ({kind}): {holders} of the {t} shares needed to unmask "
                                         f"client {owner} can arrive (too many dropouts for secagg.threshold); the "
                                         "phase cannot be aggregated")
        schemas = {r.payload["schema"] for r in masked.values()}
        if len(schemas) > 1:
            raise FedltError(f"round {rnd} ({kind}): the clients' replies differ in entries or shapes; secure "
                             "aggregation sums replies of one layout (set secagg.enabled=false for this method)")
        unmask = send(UNMASK, rnd, [(c, Message(payload={"alive": sorted(set(inbox[c]) & set(masked)),
                                                         "dropped": sorted(set(inbox[c]) - set(masked))}))
                                    for c in sorted(masked)])
        total = np.zeros_like(next(iter(masked.values())).payload["masked"])
        for reply in masked.values():
            total = total + reply.payload["masked"]
        for u in sorted(masked):
            seed = self._recover(unmask, "seed_shares", u, t, rnd, kind)
            total = total - _mask(seed, total.size)
        for d in sorted(set(shares) - set(masked)):
            sk_s = self._recover(unmask, "key_shares", d, t, rnd, kind).decode()
            for u in groups[d]:
                if u != d and u in masked:
                    pair = _pair_mask(sk_s, keys[u].payload["pk_s"], total.size)
                    total = total - pair if u < d else total + pair
        values = total.view(np.int64).astype(np.float64) / 2.0 ** self.cfg.fraction_bits
        return {AGGREGATE: unflatten(json.loads(schemas.pop()), values, mode, self.device)}

    @staticmethod
    def _recover(unmask: dict[int, Reply], entry: str, owner: int, t: int, rnd: int, kind: str) -> bytes:
        shamir, _, _ = flower_crypto()
        shares = [_unb64(r.payload[entry][owner]) for r in unmask.values() if owner in r.payload[entry]]
        if len(shares) < t:
            raise TooFewForSecureSum(f"round {rnd} ({kind}): {len(shares)} of the {t} shares needed to unmask "
                                     f"client {owner} arrived (clients dropped out while unmasking); the phase cannot "
                                     "be aggregated")
        return shamir.combine_shares(shares[:t])
