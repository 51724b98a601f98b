"""ctypes mirrors of the C decoder step's descriptors (csrc/llorch.h): keep the two in step.

The library reports its own sizes and offsets (llorch_struct_layout, in C_LAYOUT_ORDER), and a
test compares them with these, so a field added on one side only fails a test, not a step.
"""

from __future__ import annotations

import ctypes

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class Matrix(ctypes.Structure):
    _fields_ = [("type", _I32), ("unused", _I32), ("data", _P), ("rows", _I64), ("cols", _I64)]


class LayerDesc(ctypes.Structure):
    _fields_ = [
        *((name, Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")),
        *((name, _P) for name in ("q_bias", "k_bias", "v_bias", "o_bias", "input_norm", "post_attn_norm",
                                  "pre_ffn_norm", "post_ffn_norm", "q_norm", "k_norm", "keys", "values")),
        ("window", _I32), ("rope", _I32), ("kv_slots", _I64),
    ]


class ModelDesc(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "layers")),
        *((name, _F) for name in ("eps", "attn_scale", "embed_scale", "logit_softcap")),
        ("sandwich", _I32), ("activation", _I32),
        ("embed", ctypes.POINTER(Matrix)), ("final_norm", _P), ("head", ctypes.POINTER(Matrix)),
        ("layer", ctypes.POINTER(LayerDesc)), ("inv_freq", _P * 2), ("rope_scaling", _F * 2),
    ]


class StepDesc(ctypes.Structure):
    _fields_ = [
        ("rows", _I64), ("tokens", _P), ("positions", _P), ("write_slots", _P), ("slot_start", _P), ("slots", _P),
        ("logit_rows_count", _I64), ("logit_rows", _P), ("logits", _P), ("best", _P), ("prompt_from", _I64),
    ]


# The structs in the order llorch_struct_layout numbers them.
C_LAYOUT_ORDER: tuple[type[ctypes.Structure], ...] = (Matrix, LayerDesc, ModelDesc, StepDesc)


def layout(struct: type[ctypes.Structure]) -> list[int]:
    """sizeof, then every field's offset, as this side lays the struct out."""
    return [ctypes.sizeof(struct), *(getattr(struct, name).offset for name, *_ in struct._fields_)]


def c_layout(lib: ctypes.CDLL, struct: type[ctypes.Structure]) -> list[int]:
    """The same, as the compiled library lays it out."""
    out = (ctypes.c_int64 * 64)()
    count = lib.llorch_struct_layout(C_LAYOUT_ORDER.index(struct), out)
    return list(out[:count])
