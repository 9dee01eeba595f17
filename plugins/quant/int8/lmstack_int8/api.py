"""lmstack-int8's public surface: what another distribution may import from it (lmstack-eagle
multiplies its draft head by int8 rows through these). Everything else in `lmstack_int8` is
internal; a change to a name here is a change of lmstack-int8's major version.

- `int8_table(weight, exact_fp32, use_native=True, int8_activations=False)`: an `Int8Linear`
  of a dense [rows, cols] weight (one symmetric scale per row).
- `Int8Linear`: the layer (`rows(ids, dtype)` dequantizes output rows, as an embedding does).
- `EXTENSION`: the C++ kernel (`lmstack.kernels.native.NativeExtension`); `EXTENSION.load_error()`
  says why it is unavailable, or None.
"""

from lmstack_int8.head import int8_table
from lmstack_int8.linear import Int8Linear
from lmstack_int8.native import EXTENSION

__all__ = ["EXTENSION", "Int8Linear", "int8_table"]
