"""The codec's ulp arithmetic in numpy's whole-array form: the reference the compiled kernels
(`fedrl.patch_kernels`) are tested against."""

import numpy as np


def ordered(bits: np.ndarray, is_float: bool) -> np.ndarray:
    """Bit patterns as signed integers in the order of the values they encode (an involution):
    the difference of two floats' keys is their exact distance in ulps, across zero too."""
    signed = bits.view(bits.dtype.str.replace("u", "i"))
    if not is_float:
        return signed
    magnitude = np.iinfo(signed.dtype).max
    return signed ^ ((signed >> (8 * signed.dtype.itemsize - 1)) & signed.dtype.type(magnitude))


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Signed -> unsigned with small magnitudes small: 0, -1, 1, -2 ... -> 0, 1, 2, 3 ..."""
    bits = diff.dtype.itemsize * 8
    return ((diff << 1) ^ (diff >> (bits - 1))).view(diff.dtype.str.replace("i", "u"))
