"""One attention call, checked once before anything reaches a GPU.

- attention_problem.py: :class:`AttentionProblem`, built by each entry point from its
  arguments' metadata (the ``from_*`` constructors), and what dispatch matches against;
- checks.py: the argument checks it is made of, on metadata only;
- contents.py: the checks that read array contents (a device-to-host copy), for the serving
  entry points' ``check_contents=True``.
"""

from .attention_problem import DECODE_QUERIES, AttentionProblem
from .checks import (ALIGN_BYTES, E4M3, SCALE_BLOCK_ROWS, byte_extent, check_e4m3,
                     check_positive_strides, check_rows, descale_shapes, dtype_of, rows_overlap)
from .contents import check_kvcache_contents, check_varlen_contents

__all__ = ["AttentionProblem", "DECODE_QUERIES", "ALIGN_BYTES", "E4M3", "SCALE_BLOCK_ROWS",
           "byte_extent", "check_e4m3", "check_positive_strides", "check_rows", "descale_shapes",
           "dtype_of", "rows_overlap", "check_kvcache_contents", "check_varlen_contents"]
