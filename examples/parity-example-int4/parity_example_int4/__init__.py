"""``example_int4``: 4-bit symmetric weights, two codes a byte along the input (the low nibble first, code
``q`` meaning ``q - 8``), one fp16 scale per group of ``group_size`` inputs and output channel:
``<module>.qweight`` uint8 ``(N, K/2)``, ``<module>.qscale`` fp16 ``(N, K/group_size)``."""
