"""Broken and hostile model files, made from good ones, and a runner that loads each and sorts the outcome.

Cases are built from a valid file's own layout, as `gguf.GGUFReader` reads it (an independent reader,
not edgellm's checks): every header count, string and array length, metadata type and value, tensor
dimension, type and offset set to values that lie, plus truncations at every tensor boundary and inside
the header, removed, renamed and duplicated tensors and keys, and seeded random byte flips. The same for
safetensors headers, config.json, tokenizer.json and tokenizer_config.json.

A case passes when loading (and one short generation, if the load succeeds) either works or raises an
`edgellm.errors.*` error whose message names the file; anything else (another exception, a hang, an
allocation the memory limit refuses, a crash of the process) fails. `run_worker` runs cases in a child
process under RLIMIT_AS and a per-case alarm, so a lying header that makes something allocate gigabytes or
loop for ever shows up as a failure, not as a stuck CI machine.
"""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

U64_MAX = (1 << 64) - 1
HUGE_U64 = [U64_MAX, 1 << 63, 1 << 40, 1 << 32]
# GGUF value types (gguf.GGUFValueType) and their struct formats
SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass
class Case:
    """One mutated model. `build(workdir) → model path`; `must_fail`: the mutation breaks the file for sure
    (a success would mean a lie went unnoticed), else a clean load is also acceptable."""

    name: str
    build: Callable[[Path], Path]
    must_fail: bool = True


# ------------------------------------------------------------------------------------------------
# GGUF: the layout of a valid file, read by gguf.GGUFReader
# ------------------------------------------------------------------------------------------------
@dataclass
class KVAt:
    key: str
    start: int  # the key's length prefix
    end: int
    type_at: int  # the value type (u32)
    vtype: int
    item_type: int | None = None
    count: int = 0
    value: object = None


@dataclass
class TensorAt:
    name: str
    start: int  # the name's length prefix
    end: int
    n_dims: int
    dims_at: int
    type_at: int
    offset_at: int
    offset: int
    data_start: int
    data_end: int


@dataclass
class GGUFMap:
    kvs: list[KVAt]
    tensors: list[TensorAt]
    infos_end: int  # end of the tensor infos
    data_start: int
    alignment: int


def gguf_map(path: Path) -> GGUFMap:
    import gguf

    r = gguf.GGUFReader(str(path))
    kvs = []
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        sizes = [int(p.nbytes) for p in f.parts]
        type_at = f.offset + sizes[0] + sizes[1]
        vtype = int(f.types[0])
        kv = KVAt(f.name, f.offset, f.offset + sum(sizes), type_at, vtype)
        if vtype == ARRAY:
            kv.item_type, kv.count = int(f.parts[3][0]), int(f.parts[4][0])
        else:
            kv.value = f.contents()
        kvs.append(kv)
    tensors = []
    for t in r.tensors:
        sizes = [int(p.nbytes) for p in t.field.parts]
        s = t.field.offset
        at = [s + sum(sizes[:k]) for k in range(len(sizes) + 1)]
        tensors.append(TensorAt(t.name, s, at[-1], len(t.shape), at[3], at[4], at[5], int(t.field.parts[5][0]),
                                t.data_offset, t.data_offset + t.n_bytes))
    infos_end = max((t.end for t in tensors), default=max(k.end for k in kvs))
    return GGUFMap(kvs, tensors, infos_end, r.data_offset, r.alignment)


def enc_str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def enc_value(vtype: int, value, item_type: int | None = None) -> bytes:
    out = struct.pack("<I", vtype)
    if vtype == STRING:
        return out + enc_str(value)
    if vtype == ARRAY:
        out += struct.pack("<IQ", item_type, len(value))
        return out + b"".join(enc_value(item_type, v)[4:] for v in value)
    return out + struct.pack("<" + SCALAR_FMT[vtype], value)


def enc_kv(key: str, vtype: int, value, item_type: int | None = None) -> bytes:
    return enc_str(key) + enc_value(vtype, value, item_type)


def _u64(x: int) -> bytes:
    return struct.pack("<Q", x & U64_MAX)


def _u32(x: int) -> bytes:
    return struct.pack("<I", x & 0xFFFFFFFF)


def patched(data: bytes, *patches: tuple[int, bytes]) -> bytes:
    out = bytearray(data)
    for at, b in patches:
        out[at:at + len(b)] = b
    return bytes(out)


def rebuilt(data: bytes, m: GGUFMap, kv_bytes: dict[int, bytes] | None = None, extra_kv: bytes = b"",
            n_kv_delta: int = 0, drop_tensors: set[int] = frozenset(), infos: dict[int, bytes] | None = None) -> bytes:
    """A GGUF with some metadata entries replaced (index → new bytes, b"" removes one) or added, and some
    tensor infos dropped or replaced; the header is re-padded so the tensor data keeps its alignment."""
    kv_bytes, infos = kv_bytes or {}, infos or {}
    removed = sum(1 for b in kv_bytes.values() if b == b"")
    head = bytearray(data[:24])
    n_t, n_kv = struct.unpack_from("<QQ", data, 8)
    struct.pack_into("<QQ", head, 8, n_t - len(drop_tensors), n_kv - removed + n_kv_delta)
    body = bytearray()
    for i, kv in enumerate(m.kvs):
        body += kv_bytes.get(i, data[kv.start:kv.end])
    body += extra_kv
    for i, t in enumerate(m.tensors):
        if i not in drop_tensors:
            body += infos.get(i, data[t.start:t.end])
    header = bytes(head + body)
    pad = -len(header) % m.alignment
    return header + b"\0" * pad + data[m.data_start:]


def _writer(data: bytes, name: str) -> Callable[[Path], Path]:
    def build(work: Path) -> Path:
        p = work / name
        p.write_bytes(data)
        return p
    return build


def _lazy(make: Callable[[], bytes], name: str) -> Callable[[Path], Path]:
    def build(work: Path) -> Path:
        p = work / name
        p.write_bytes(make())
        return p
    return build


def gguf_cases(path: Path, rng: random.Random, n_random: int = 50) -> Iterator[Case]:
    """Every structural lie for every field of the file at `path`, then `n_random` seeded byte flips."""
    data = path.read_bytes()
    m = gguf_map(path)
    size = len(data)
    fname = "model.gguf"

    def case(name: str, make: Callable[[], bytes], must_fail: bool = True) -> Case:
        return Case(f"gguf:{path.name}:{name}", _lazy(make, fname), must_fail)

    # header
    for v in (0, 1, 4, 0xFFFF, 0xFFFFFFFF):
        yield case(f"version={v}", lambda v=v: patched(data, (4, _u32(v))))
    n_t, n_kv = struct.unpack_from("<QQ", data, 8)
    for what, at, n in (("n_tensors", 8, n_t), ("n_kv", 16, n_kv)):
        for v in HUGE_U64 + [n + 1, n + 1000, size]:
            yield case(f"{what}={v}", lambda at=at, v=v: patched(data, (at, _u64(v))))
        yield case(f"{what}={n - 1}", lambda at=at, n=n: patched(data, (at, _u64(n - 1))))
    yield case("n_kv=0", lambda: patched(data, (16, _u64(0))))
    yield case("n_tensors=0", lambda: patched(data, (8, _u64(0))))
    # metadata entries: lengths, types, counts
    for i, kv in enumerate(m.kvs):
        k = kv.key
        klen = kv.type_at - kv.start - 8
        for v in HUGE_U64 + [klen + 1, size, 0]:
            yield case(f"kv[{k}].key_len={v}", lambda kv=kv, v=v: patched(data, (kv.start, _u64(v))))
        yield case(f"kv[{k}].key=invalid-utf8", lambda kv=kv: patched(data, (kv.start + 8, b"\xff")))
        for t in (9 if kv.vtype != 9 else 8, 13, 0xFFFFFFFF, rng.choice([0, 4, 6, 7, 10, 12])):
            yield case(f"kv[{k}].type={t}", lambda kv=kv, t=t: patched(data, (kv.type_at, _u32(t))),
                       must_fail=False)
        value_at = kv.type_at + 4
        if kv.vtype == STRING:
            n = len(str(kv.value).encode())
            for v in HUGE_U64 + [size, n + size]:
                yield case(f"kv[{k}].strlen={v}", lambda value_at=value_at, v=v: patched(data, (value_at, _u64(v))))
            if n:
                yield case(f"kv[{k}].str=invalid-utf8",
                           lambda value_at=value_at: patched(data, (value_at + 8, b"\xc3\x28")), must_fail=False)
        if kv.vtype == ARRAY:
            for v in HUGE_U64 + [kv.count + 1, kv.count * 2 + 10, 1 << 24]:
                yield case(f"kv[{k}].array_len={v}", lambda value_at=value_at, v=v: patched(data, (value_at + 4, _u64(v))))
            yield case(f"kv[{k}].array_len=0", lambda value_at=value_at: patched(data, (value_at + 4, _u64(0))))
            for t in (9, 13, 0xFFFFFFFF, 8 if kv.item_type != 8 else 10):
                yield case(f"kv[{k}].item_type={t}", lambda value_at=value_at, t=t: patched(data, (value_at, _u32(t))))
            if kv.item_type == STRING and kv.count:
                for v in HUGE_U64 + [size]:
                    yield case(f"kv[{k}][0].strlen={v}", lambda value_at=value_at, v=v: patched(data, (value_at + 12, _u64(v))))
        # the same key twice, and the entry removed
        yield case(f"kv[{k}].duplicated", lambda kv=kv: rebuilt(data, m, extra_kv=data[kv.start:kv.end], n_kv_delta=1))
        yield case(f"kv[{k}].removed", lambda i=i: rebuilt(data, m, kv_bytes={i: b""}), must_fail=False)
    yield from _metadata_value_cases(data, m, case, rng)
    # tensor infos
    names = [t.name for t in m.tensors]
    for i, t in enumerate(m.tensors):
        nm = t.name
        nlen = t.dims_at - 4 - t.start - 8
        for v in HUGE_U64 + [nlen + 1, size]:
            yield case(f"t[{nm}].name_len={v}", lambda t=t, v=v: patched(data, (t.start, _u64(v))))
        for v in (0, 5, 0xFFFFFFFF, t.n_dims + 1):
            yield case(f"t[{nm}].n_dims={v}", lambda t=t, v=v: patched(data, (t.dims_at - 4, _u32(v))))
        for j in range(t.n_dims):
            d = struct.unpack_from("<Q", data, t.dims_at + 8 * j)[0]
            for v in HUGE_U64 + [0, d * 2, d + 32, (1 << 63) + d]:
                yield case(f"t[{nm}].dim{j}={v}", lambda t=t, j=j, v=v: patched(data, (t.dims_at + 8 * j, _u64(v))))
        for v in (4, 5, 31, 100, 0xFFFFFFFF, rng.choice([0, 1, 2, 8, 12, 14, 24, 30])):
            yield case(f"t[{nm}].type={v}", lambda t=t, v=v: patched(data, (t.type_at, _u32(v))), must_fail=False)
        for v in HUGE_U64 + [t.offset + 1, t.offset + m.alignment * 4096, size, size - m.data_start]:
            yield case(f"t[{nm}].offset={v}", lambda t=t, v=v: patched(data, (t.offset_at, _u64(v))))
        if i:
            other = m.tensors[0].offset
            yield case(f"t[{nm}].offset=overlaps[0]", lambda t=t, o=other: patched(data, (t.offset_at, _u64(o))))
        twin = next((n for n in names if n != nm and len(n) == len(nm)), None)
        if twin:
            yield case(f"t[{nm}].renamed={twin}", lambda t=t, tw=twin: patched(data, (t.start + 8, tw.encode())))
        yield case(f"t[{nm}].renamed=x", lambda t=t: patched(data, (t.start + 8, b"x")), must_fail=False)
        yield case(f"t[{nm}].removed", lambda i=i: rebuilt(data, m, drop_tensors={i}), must_fail=False)
    # truncation: inside the header (at and after each entry's start), at every tensor boundary
    cuts = {5, 9, 16, 23, 24, m.infos_end, m.data_start}
    for kv in m.kvs:
        cuts |= {kv.start, kv.start + 4, kv.type_at + 2, kv.end - 1}
    for t in m.tensors:
        cuts |= {t.start + 3, t.offset_at + 4, t.data_start, t.data_start + 1, t.data_end - 1, t.data_end}
    last_data = max((t.data_end for t in m.tensors), default=m.data_start)
    for c in sorted(x for x in cuts if 0 < x < size):
        yield case(f"truncated@{c}", lambda c=c: data[:c], must_fail=c < last_data)
    # seeded random damage in the header: byte flips, overwritten 8-byte words
    for k in range(n_random):
        seed = rng.randrange(1 << 30)
        yield case(f"random[{seed}]", lambda seed=seed: _random_damage(data, m.infos_end, seed), must_fail=False)


def _random_damage(data: bytes, header_end: int, seed: int) -> bytes:
    r = random.Random(seed)
    out = bytearray(data)
    for _ in range(r.randint(1, 8)):
        at = r.randrange(8, header_end)
        if r.random() < 0.5:
            out[at] ^= 1 << r.randrange(8)
        else:
            out[at:at + 8] = r.choice([b"\xff" * 8, b"\0" * 8, r.randbytes(8)])[:len(out) - at]
    return bytes(out)


def _metadata_value_cases(data: bytes, m: GGUFMap, case, rng: random.Random) -> Iterator[Case]:
    """Metadata of the wrong type and values out of range, for the keys a loader reads."""
    arch = next(kv.value for kv in m.kvs if kv.key == "general.architecture")
    wrong = [("string", STRING, "abc", None), ("float", 6, 1.5, None), ("int32=-1", 5, -1, None),
             ("bool", 7, True, None), ("u64-huge", 10, U64_MAX, None), ("array-int", ARRAY, [1, 2], 5),
             ("array-str", ARRAY, ["a"], STRING)]
    for i, kv in enumerate(m.kvs):
        for label, vtype, value, item in wrong:
            if vtype == kv.vtype and (item is None or item == kv.item_type):
                continue
            yield case(f"kv[{kv.key}]={label}", lambda i=i, kv=kv, vtype=vtype, value=value, item=item:
                       rebuilt(data, m, kv_bytes={i: enc_kv(kv.key, vtype, value, item)}), must_fail=False)
        if kv.vtype in (4, 5, 10, 11) and kv.key.startswith(arch + "."):
            for v in (0, 1, 3, 0x7FFFFFFF, 0xFFFFFFFF, (kv.value or 1) * 2, (kv.value or 0) + 1):
                yield case(f"kv[{kv.key}]={v}", lambda i=i, kv=kv, v=v:
                           rebuilt(data, m, kv_bytes={i: enc_kv(kv.key, 4, v)}), must_fail=False)
        if kv.vtype in (6, 12):
            for v in (0.0, -1.0, float("nan"), float("inf"), 1e300):
                yield case(f"kv[{kv.key}]={v}", lambda i=i, kv=kv, v=v:
                           rebuilt(data, m, kv_bytes={i: enc_kv(kv.key, 12, v)}), must_fail=False)
    tokens = next((kv for kv in m.kvs if kv.key == "tokenizer.ggml.tokens"), None)
    n_tok = tokens.count if tokens else 0
    special = [("tokenizer.ggml.bos_token_id", 4, n_tok), ("tokenizer.ggml.eos_token_id", 4, n_tok + 5),
               ("tokenizer.ggml.eot_token_id", 4, 0xFFFFFFFF), ("tokenizer.ggml.model", STRING, "bert"),
               ("tokenizer.ggml.pre", STRING, "no-such-pre"), ("general.architecture", STRING, "gpt2"),
               ("general.architecture", STRING, ""), ("general.alignment", 4, 3), ("general.alignment", 4, 0),
               ("general.alignment", 10, 32), ("general.alignment", 4, 1 << 31),
               ("tokenizer.ggml.merges", ARRAY, ["zz qq", "a"], STRING),
               ("tokenizer.ggml.merges", ARRAY, ["\u0120 \u0120" * 3], STRING),
               ("tokenizer.ggml.token_type", ARRAY, [1, 2, 3], 5), ("tokenizer.ggml.scores", ARRAY, [0.5], 6),
               ("tokenizer.ggml.tokens", ARRAY, [], STRING), ("tokenizer.ggml.tokens", ARRAY, ["a", "a", "b"], STRING),
               (f"{arch}.rope.scaling.type", STRING, "su"), (f"{arch}.rope.scaling.type", STRING, "yarn"),
               (f"{arch}.rope.scaling.factor", 6, 0.0), (f"{arch}.attention.head_count_kv", ARRAY, [1, 2], 5)]
    index = {kv.key: i for i, kv in enumerate(m.kvs)}
    for key, vtype, value, *item in special:
        item = item[0] if item else None
        entry = enc_kv(key, vtype, value, item)
        label = f"kv[{key}]:={str(value)[:30]}"
        if key in index:
            yield case(label, lambda i=index[key], e=entry: rebuilt(data, m, kv_bytes={i: e}), must_fail=False)
        else:
            yield case(label, lambda e=entry: rebuilt(data, m, extra_kv=e, n_kv_delta=1), must_fail=False)


# ------------------------------------------------------------------------------------------------
# Hugging Face folders: safetensors headers, config.json, tokenizer files
# ------------------------------------------------------------------------------------------------
def _folder_case(name: str, src: Path, edit: Callable[[Path], None], must_fail: bool = True) -> Case:
    def build(work: Path) -> Path:
        folder = work / "model"
        shutil.copytree(src, folder)
        edit(folder)
        return folder
    return Case(name, build, must_fail)


def _split_safetensors(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", data, 0)[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join_safetensors(header: dict, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def safetensors_cases(folder: Path, rng: random.Random) -> Iterator[Case]:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    header, body = _split_safetensors(data)
    size = len(data)
    n = struct.unpack_from("<Q", data, 0)[0]

    def case(name: str, make: Callable[[], bytes], must_fail: bool = True) -> Case:
        def edit(f: Path) -> None:
            (f / "model.safetensors").write_bytes(make())
        return _folder_case(f"safetensors:{name}", folder, edit, must_fail)

    def with_entry(tname: str, **changes) -> Callable[[], bytes]:
        def make() -> bytes:
            h = json.loads(json.dumps(header))
            h[tname].update(changes)
            return _join_safetensors(h, body)
        return make

    for v in HUGE_U64 + [size, size - 7, n + 1, 0, 1]:
        yield case(f"header_len={v}", lambda v=v: _u64(v) + data[8:])
    yield case("header=not-json", lambda: _u64(n) + b"{" * n + data[8 + n:])
    yield case("header=invalid-utf8", lambda: _u64(n) + b"\xff" * n + data[8 + n:])
    yield case("header=list", lambda: _join_safetensors([1, 2], body))  # type: ignore[arg-type]
    yield case("metadata=wrong-type", lambda: _join_safetensors({**header, "__metadata__": {"a": 1}}, body))
    names = [k for k in header if k != "__metadata__"]
    picked = names if len(names) <= 12 else rng.sample(names, 12)
    for t in picked:
        begin, end = header[t]["data_offsets"]
        shape = header[t]["shape"]
        for label, offs in (("huge", [0, 1 << 62]), ("reversed", [end, begin]), ("negative", [-8, end]),
                            ("past-end", [begin + len(body), end + len(body)]), ("shifted", [begin + 1, end + 1]),
                            ("strings", ["0", str(end)]), ("short", [begin])):
            yield case(f"{t}.offsets={label}", with_entry(t, data_offsets=offs))
        for label, sh in (("huge", [1 << 40, 1 << 40]), ("negative", [-1] + shape[1:]), ("strings", ["a"]),
                          ("doubled", [shape[0] * 2] + shape[1:]), ("nested", [[1]])):
            yield case(f"{t}.shape={label}", with_entry(t, shape=sh))
        for dt in ("F64", "Q4_0", 7, None):
            yield case(f"{t}.dtype={dt}", with_entry(t, dtype=dt))
        yield case(f"{t}.entry=list", lambda t=t: _join_safetensors({**header, t: [1]}, body))
        yield case(f"{t}.removed", lambda t=t: _join_safetensors({k: v for k, v in header.items() if k != t}, body),
                   must_fail=False)
    a, b = picked[0], picked[1]
    yield case(f"{b}.offsets=overlap-{a}", with_entry(b, data_offsets=header[a]["data_offsets"]), must_fail=False)
    for c in sorted({4, 8, 9, 8 + n // 2, 8 + n, 8 + n + 1, size // 2, size - 1}):
        yield case(f"truncated@{c}", lambda c=c: data[:c])


def _json_edit(file: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        p = folder / file
        d = json.loads(p.read_text()) if p.is_file() else {}
        out = change(d)
        p.write_text(out if isinstance(out, str) else json.dumps(out if out is not None else d))
    return edit


WRONG_VALUES = [("string", "abc"), ("float", 1.5), ("list", [1]), ("dict", {"a": 1}), ("null", None),
                ("bool", True), ("zero", 0), ("negative", -3), ("huge", 1 << 40), ("nan-string", "NaN")]


def config_cases(folder: Path) -> Iterator[Case]:
    cfg = json.loads((folder / "config.json").read_text())

    def case(name: str, change, must_fail: bool = False) -> Case:
        return _folder_case(f"config.json:{name}", folder, _json_edit("config.json", change), must_fail)

    yield case("not-json", lambda d: "{not json", must_fail=True)
    yield case("empty", lambda d: "", must_fail=True)
    yield case("list", lambda d: [1, 2], must_fail=True)
    yield case("binary", lambda d: "\x00\x01\x02", must_fail=True)
    for key in list(cfg):
        yield case(f"{key}.removed", lambda d, key=key: {k: v for k, v in d.items() if k != key})
        for label, value in WRONG_VALUES:
            yield case(f"{key}={label}", lambda d, key=key, value=value: {**d, key: value})
    for label, sc in (("factor0", {"rope_type": "linear", "factor": 0}), ("unknown", {"rope_type": "su", "factor": 2}),
                      ("llama3-equal", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                      ("yarn-zero", {"rope_type": "yarn", "factor": 0.0}), ("list", [1]), ("no-type", {"factor": 2}),
                      ("yarn-neg", {"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}),
                      ("factor-string", {"rope_type": "linear", "factor": "2"})):
        yield case(f"rope_scaling={label}", lambda d, sc=sc: {**d, "rope_scaling": sc})
    yield case("heads-not-dividing", lambda d: {**d, "num_key_value_heads": 3})
    yield case("head_dim=odd", lambda d: {**d, "head_dim": 15})
    yield case("hidden_size-mismatch", lambda d: {**d, "hidden_size": d["hidden_size"] * 2}, must_fail=True)
    yield case("layers-more-than-file", lambda d: {**d, "num_hidden_layers": 1000000}, must_fail=True)
    yield case("vocab-mismatch", lambda d: {**d, "vocab_size": d["vocab_size"] + 1}, must_fail=True)
    yield case("untied-without-lm_head", lambda d: {**d, "tie_word_embeddings": False})


def tokenizer_cases(folder: Path) -> Iterator[Case]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())

    def case(file: str, name: str, change, must_fail: bool = False) -> Case:
        return _folder_case(f"{file}:{name}", folder, _json_edit(file, change), must_fail)

    yield case("tokenizer.json", "not-json", lambda d: "{", must_fail=True)
    yield case("tokenizer.json", "empty-object", lambda d: {}, must_fail=True)
    yield case("tokenizer.json", "list", lambda d: [1], must_fail=True)
    yield case("tokenizer.json", "model.removed", lambda d: {k: v for k, v in d.items() if k != "model"}, True)
    for label, value in WRONG_VALUES[:6]:
        yield case("tokenizer.json", f"model.vocab={label}", lambda d, v=value: {**d, "model": {**d["model"], "vocab": v}})
        yield case("tokenizer.json", f"model.merges={label}", lambda d, v=value: {**d, "model": {**d["model"], "merges": v}})
        yield case("tokenizer.json", f"added_tokens={label}", lambda d, v=value: {**d, "added_tokens": v})
        yield case("tokenizer.json", f"pre_tokenizer={label}", lambda d, v=value: {**d, "pre_tokenizer": v})
    yield case("tokenizer.json", "merges-unknown", lambda d: {**d, "model": {**d["model"], "merges": [["zz", "qq"]]}})
    big = len(tok["model"]["vocab"]) + 10_000
    yield case("tokenizer.json", "vocab-past-model", lambda d: {**d, "model": {**d["model"], "vocab": {
        **d["model"]["vocab"], "zzzz": big}}}, must_fail=True)
    yield case("tokenizer.json", "added-token-past-model", lambda d: {**d, "added_tokens": d["added_tokens"] + [{
        "id": big, "content": "<|big|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
        "special": True}]}, must_fail=True)
    for key in list(tcfg):
        for label, value in WRONG_VALUES[:7]:
            yield case("tokenizer_config.json", f"{key}={label}", lambda d, key=key, v=value: {**d, key: v})
    yield case("tokenizer_config.json", "chat_template=list-garbage", lambda d: {**d, "chat_template": [1, "x", {}]})
    yield case("tokenizer_config.json", "chat_template=list-no-default",
               lambda d: {**d, "chat_template": [{"name": "tool_use", "template": "x"}]})
    yield case("tokenizer_config.json", "bos=unknown-token", lambda d: {**d, "bos_token": "<nope>"})
    yield case("tokenizer_config.json", "not-json", lambda d: "[", must_fail=True)
    for label, value in WRONG_VALUES[:6]:
        yield case("generation_config.json", f"eos_token_id={label}", lambda d, v=value: {**d, "eos_token_id": v})
    yield case("config.json", "bos_token_id=huge", lambda d: {**d, "bos_token_id": 1 << 40})


# ------------------------------------------------------------------------------------------------
# Running cases
# ------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    name: str
    result: str  # "loaded" | "refused" | "FAIL"
    detail: str
    seconds: float


def probe(path: Path, generate: bool = True) -> None:
    """What a user does with a model: load it, then (when it loads) chat one short turn."""
    from edgellm.generate import Engine, GenerationSettings
    from edgellm.loading import load_model
    from edgellm.sampling import SamplingSettings

    lm = load_model(path, max_seq_len=64)
    if not generate:
        return
    tok = lm.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}]) if tok.chat_template else tok.encode("Hi")
    settings = GenerationSettings(max_tokens=3, sampling=SamplingSettings(temperature=0.8, seed=0))
    for _ in Engine(lm.model, tok).generate(ids[-32:] or [0], settings):
        pass


class CaseTimeout(BaseException):
    """Raised by the per-case alarm (a BaseException so no `except Exception` in the code under test eats it)."""


def run_case(c: Case, work: Path, timeout_s: float = 60.0, generate: bool = True) -> Outcome:
    from edgellm.errors import ContextOverflowError, EdgeLLMError

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    path = c.build(work)
    t0 = time.perf_counter()

    def on_alarm(signum, frame):
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        probe(path, generate)
        result, detail = ("FAIL", "loaded a file that must be refused") if c.must_fail else ("loaded", "")
    except EdgeLLMError as e:
        msg = str(e)
        # a prompt longer than the context a file declares is the user's limit, not the file's fault
        named = str(path) in msg or str(work) in msg or isinstance(e, ContextOverflowError)
        one_line = "\n" not in msg.strip()
        result = "refused" if named and one_line else "FAIL"
        detail = f"{type(e).__name__}: {msg}" + ("" if named else "  [message does not name the file]")
    except CaseTimeout:
        result, detail = "FAIL", f"timeout after {timeout_s} s"
    except BaseException as e:  # noqa: BLE001 - the point is to catch what should not happen
        if isinstance(e, KeyboardInterrupt):
            raise
        import traceback

        tb = traceback.extract_tb(e.__traceback__)[-1]
        result, detail = "FAIL", f"{type(e).__name__}: {str(e)[:200]} (at {Path(tb.filename).name}:{tb.lineno})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(c.name, result, detail.replace(str(work), "<work>")[:400], time.perf_counter() - t0)


def all_cases(sources: dict[str, tuple[Path, Path]], seed: int, n_random: int = 50,
              bundled: Path | None = None, bundled_count: int = 300) -> list[Case]:
    """Every case for each tiny model (HF folder + GGUF), and a seeded sample of `bundled_count` header cases
    that must fail for the bundled GGUF (each writes a 98 MB file: all ~7000 would take an hour)."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for folder, gguf_file in sources.values():
        cases += list(gguf_cases(gguf_file, rng, n_random))
        cases += list(safetensors_cases(folder, rng))
        cases += list(config_cases(folder))
        cases += list(tokenizer_cases(folder))
    if bundled is not None:
        cases += sample([c for c in gguf_cases(bundled, rng, n_random) if c.must_fail], bundled_count, seed)
    return cases


def sample(cases: list[Case], count: int | None, seed: int) -> list[Case]:
    if count is None or count >= len(cases):
        return cases
    return random.Random(seed).sample(cases, count)


def set_memory_limit(extra_bytes: int) -> None:
    """Cap the address space at what this process maps now plus `extra_bytes`: a lying header that makes
    anything allocate gigabytes fails with MemoryError (a FAIL) instead of swapping the machine."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_bytes, vm + extra_bytes))


def worker_main(argv: list[str]) -> int:
    """python -m tests.fuzz_cases SPEC.json OUT.jsonl: run the cases SPEC names (skipping the first
    spec["skip"]) in this process, under the memory limit it gives; one JSON line per outcome, written as
    it comes, so a crash of the process still leaves the outcomes before it."""
    spec = json.loads(Path(argv[0]).read_text())
    import torch

    torch.set_num_threads(1)
    from edgellm.loading import load_model  # noqa: F401 - imports (and maps) everything before the limit

    sources = {k: (Path(a), Path(b)) for k, (a, b) in spec["sources"].items()}
    bundled = Path(spec["bundled"]) if spec.get("bundled") else None
    cases = all_cases(sources, spec["seed"], spec["n_random"], bundled, spec.get("bundled_count", 300))
    if spec.get("names"):  # the cases of these names only (every source's), else a seeded sample
        cases = [c for c in cases if c.name in set(spec["names"])]
    else:
        cases = sample(cases, spec.get("sample"), spec["seed"])
    if spec.get("memory_limit"):
        set_memory_limit(spec["memory_limit"])
    work = Path(spec["work"])
    with open(argv[1], "a") as out:
        if not spec.get("skip"):
            out.write(json.dumps({"total": len(cases)}) + "\n")
        for i, c in enumerate(cases):
            if i < spec.get("skip", 0):
                continue
            out.write(json.dumps({"next": c.name}) + "\n")  # who to blame if the process dies now
            out.flush()
            o = run_case(c, work, spec.get("timeout_s", 60.0), spec.get("generate", True))
            out.write(json.dumps(o.__dict__) + "\n")
            out.flush()
            if spec.get("progress"):
                print(f"{i + 1}/{len(cases)} {o.result:8s} {o.seconds:6.2f}s {o.name}  {o.detail[:160]}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def run_worker(spec: dict, out_path: Path, timeout_s: float) -> tuple[list[Outcome], subprocess.CompletedProcess]:
    """Run the cases in child processes. A child that dies (a signal from the C++ extension, the memory
    limit's kill) costs the case it was on a FAIL, and a new child goes on after it."""
    root = Path(__file__).resolve().parents[1]
    out_path.unlink(missing_ok=True)
    spec_path = out_path.with_suffix(".spec.json")
    outcomes: list[Outcome] = []
    total, skip, deadline = None, 0, time.monotonic() + timeout_s
    while True:
        spec_path.write_text(json.dumps({**spec, "skip": skip}))
        proc = subprocess.run([sys.executable, "-m", "tests.fuzz_cases", str(spec_path), str(out_path)], cwd=root,
                              capture_output=not spec.get("progress"), text=True,
                              timeout=max(1.0, deadline - time.monotonic()),
                              env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
        outcomes, pending = [], None
        for line in out_path.read_text().splitlines():
            row = json.loads(line)
            if "total" in row:
                total = row["total"]
            elif "next" in row:
                pending = row["next"]
            else:
                outcomes.append(Outcome(**row))
                pending = None
        if proc.returncode == 0 or total is None or pending is None:
            return outcomes, proc
        with open(out_path, "a") as f:  # the child died inside a case
            f.write(json.dumps(Outcome(pending, "FAIL", f"the process died (exit {proc.returncode})", 0.0).__dict__) + "\n")
        skip = len(outcomes) + 1


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
