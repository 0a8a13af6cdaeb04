"""What an op's recorded shapes say: the one dtype table and the one decoder of ``Input Dims``.

Traces spell a tensor's dtype several ways: Kineto's ``Input type`` writes C++ names (``float``,
``c10::BFloat16``, ``long int``), ``record_param_comms`` writes c10's (``BFloat16``, ``Float``),
and users write torch's (``torch.bfloat16``). :func:`canonical` maps each to torch's name;
:data:`DTYPES` gives its size and, for floating types, the compute engine family that
:mod:`fsdpdoctor.analysis.compute` sorts GEMM time by. ``Input Dims`` / ``Input type`` arrive as
raw JSON (``ingest.events.RAW_FIELDS``) and are decoded only for the ops that need them.
"""

from __future__ import annotations

import msgspec

#: torch dtype -> (bytes per element, engine family: None for types no matmul runs in)
DTYPES: dict[str, tuple[int, str | None]] = {
    "float64": (8, "fp64"),
    "float32": (4, "fp32"),
    "float16": (2, "fp16"),
    "bfloat16": (2, "bf16"),
    "float8_e4m3fn": (1, "fp8"),
    "float8_e5m2": (1, "fp8"),
    "float8_e4m3fnuz": (1, "fp8"),
    "float8_e5m2fnuz": (1, "fp8"),
    "complex64": (8, None),
    "int64": (8, None),
    "uint64": (8, None),
    "int32": (4, None),
    "uint32": (4, None),
    "int16": (2, None),
    "uint16": (2, None),
    "int8": (1, None),
    "uint8": (1, None),
    "bool": (1, None),
}

#: the other spellings, lower-cased, without ``c10::`` / ``torch.``
ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "long int": "int64",  # Kineto's Input type for int64 tensors (2023-era traces)
    "int": "int32",
    "short": "int16",
    "char": "int8",
    "signed char": "int8",
    "unsigned char": "uint8",
    "byte": "uint8",
    "complexfloat": "complex64",
}


def canonical(name: str | None) -> str | None:
    """torch's name of a dtype spelled as traces spell it; None when it is not a known dtype."""
    if not name or not isinstance(name, str):
        return None
    key = name.strip().lower().removeprefix("c10::").removeprefix("torch.")
    key = ALIASES.get(key, key)
    return key if key in DTYPES else None


def dtype_bytes(name: str | None) -> int | None:
    """Bytes per element of a dtype as traces spell it; None when unknown."""
    c = canonical(name)
    return DTYPES[c][0] if c is not None else None


def engine(name: str | None) -> str | None:
    """The engine family (``fp32``, ``bf16``, ``fp8`` …) of a floating dtype; None otherwise."""
    c = canonical(name)
    return DTYPES[c][1] if c is not None else None


#: the engines a user picks a parameter dtype from (``fsdpdoctor plan --dtype``), with their bytes
PARAM_DTYPE_BYTES = {e: b for b, e in DTYPES.values() if e in ("fp32", "bf16", "fp16")}


def decode_list(raw) -> list:
    """A raw JSON list (``Input Dims``, ``Input type``); [] when absent, malformed or not a list."""
    if raw is None:
        return []
    try:
        d = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return []
    return d if isinstance(d, list) else []
