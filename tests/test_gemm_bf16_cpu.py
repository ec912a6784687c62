"""bf16 products on fp32 operands (cupy_rope._cublas), without a GPU: precision ``bf16`` takes both operands as
bf16 (COMPUTE_32F) or both as fp32 (COMPUTE_32F_FAST_16BF, rounded inside the product), never one of each; the
other modes still take fp32 only; and a product's description maps back to the precision that made it (the
split candidate re-issues its parts from it)."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_rope import _checks as C
from cupy_rope import _cublas

F32 = np.float32


def _arrays(m, n, k, trans_a=False, trans_b=False, a_dtype=F32, b_dtype=F32):
    a = np.zeros((k, m) if trans_a else (m, k), a_dtype)
    b = np.zeros((n, k) if trans_b else (k, n), b_dtype)
    return a, b, np.zeros((m, n), F32)


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_fp32_operands_select_fast_16bf(trans_a, trans_b):
    a, b, c = _arrays(4, 5, 3, trans_a, trans_b)
    ex = _cublas._product(a, b, c, trans_a, trans_b, "bf16")
    assert _cublas.COMPUTE_32F_FAST_16BF == 75  # cublasComputeType_t CUBLAS_COMPUTE_32F_FAST_16BF
    assert ex[5:7] == (_cublas.CUDA_R_32F, _cublas.COMPUTE_32F_FAST_16BF)
    assert ex[:5] == (4, 5, 3, trans_a, trans_b)
    assert ex[7:] == _cublas._product(a, b, c, trans_a, trans_b, "tf32")[7:]  # same row strides as fp32 operands
    a16, b16, _ = _arrays(4, 5, 3, trans_a, trans_b, C.BF16, C.BF16)
    assert _cublas._product(a16, b16, c, trans_a, trans_b, "bf16")[5:7] == (_cublas.CUDA_R_16BF, _cublas.COMPUTE_32F)


def test_padded_column_slices_as_the_schedule_passes_them():
    """grad_qkv^T [3H, padded(T)] read as its first T columns, against an fp32 weight (grad_hidden_states)."""
    gt = np.zeros((12, 32), F32)[:, :7]
    w = np.zeros((12, 4), F32)
    ex = _cublas._product(gt, w, np.zeros((7, 4), F32), True, False, "bf16")
    assert ex == (7, 4, 12, True, False, _cublas.CUDA_R_32F, _cublas.COMPUTE_32F_FAST_16BF, 32, 4,
                  _cublas.CUDA_R_32F)


@pytest.mark.parametrize("a_dtype, b_dtype, got", [(F32, C.BF16, "float32 and bfloat16"),
                                                   (C.BF16, F32, "bfloat16 and float32")])
def test_mixed_operands_are_refused(a_dtype, b_dtype, got):
    a, b, c = _arrays(4, 5, 3, a_dtype=a_dtype, b_dtype=b_dtype)
    with pytest.raises(TypeError, match=f"a and b must both be bfloat16 or both float32 for precision 'bf16', "
                                        f"got {got}: cast the float32 one"):
        _cublas._product(a, b, c, False, False, "bf16")


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_other_modes_take_fp32_only(precision):
    a, b, c = _arrays(4, 5, 3, a_dtype=C.BF16, b_dtype=C.BF16)
    with pytest.raises(TypeError, match=f"gemm a must be float32 for precision '{precision}', got bfloat16"):
        _cublas._product(a, b, c, False, False, precision)
    a, b, c = _arrays(4, 5, 3, b_dtype=C.BF16)
    with pytest.raises(TypeError, match=f"gemm b must be float32 for precision '{precision}', got bfloat16"):
        _cublas._product(a, b, c, False, False, precision)


def test_other_dtypes_are_refused_in_bf16():
    a, b, c = _arrays(4, 5, 3, a_dtype=np.float64, b_dtype=np.float64)
    with pytest.raises(TypeError, match="gemm a must be bfloat16 or float32 for precision 'bf16', got float64"):
        _cublas._product(a, b, c, False, False, "bf16")
    a, b, c = _arrays(4, 5, 3, b_dtype=np.float16)
    with pytest.raises(TypeError, match="gemm b must be bfloat16 or float32 for precision 'bf16', got float16"):
        _cublas._product(a, b, c, False, False, "bf16")
    a, b, c = _arrays(4, 5, 3)  # a bf16 output only from bf16 operands (not from fp32 ones rounded inside)
    with pytest.raises(TypeError, match="gemm c must be float32 for precision 'bf16', got bfloat16"):
        _cublas._product(a, b, c.astype(C.BF16), False, False, "bf16")
    a, b, c = _arrays(4, 5, 3, a_dtype=C.BF16, b_dtype=C.BF16)
    with pytest.raises(TypeError, match="gemm c must be float32 or bfloat16 for precision 'bf16', got float16"):
        _cublas._product(a, b, c.astype(np.float16), False, False, "bf16")


def test_bf16_output_is_described():
    """A bf16 c from bf16 operands: cuBLAS's C/D type in the product's description (and so its plan key)."""
    a, b, c = _arrays(4, 5, 3, a_dtype=C.BF16, b_dtype=C.BF16)
    assert _cublas._product(a, b, c, False, False, "bf16")[-1] == _cublas.CUDA_R_32F
    assert _cublas._product(a, b, c.astype(C.BF16), False, False, "bf16")[-1] == _cublas.CUDA_R_16BF


@pytest.mark.parametrize("precision, dtype", [("fp32", F32), ("tf32", F32), ("bf16", F32), ("bf16", C.BF16)])
def test_description_maps_back_to_its_precision(precision, dtype):
    """The split candidate issues its two parts with the precision read back from the product: fp32 operands
    in bf16 must stay FAST_16BF products (not become fp32 or tf32 ones)."""
    a, b, c = _arrays(300, 5, 3, a_dtype=dtype, b_dtype=dtype)
    ex = _cublas._product(a, b, c, False, False, precision)
    assert _cublas._precision(ex) == precision
    assert _cublas._product(a[:256], b, c[:256], False, False, _cublas._precision(ex))[5:7] == ex[5:7]

