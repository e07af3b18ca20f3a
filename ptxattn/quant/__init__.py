"""Quantizers: FP8 e4m3 (fp8.py, with the Hadamard rotations of hadamard.py, and recipe.py's
Fp8Recipe, how FP8 attention quantizes its inputs) for ptxattn.fp8, and the block-scaled MXFP8
and NVFP4 formats (blockscaled.py) for ptxattn.blockscaled. Each runs on the GPU, with a NumPy
reference that produces the same bits. The entry-point modules re-export the public names."""
