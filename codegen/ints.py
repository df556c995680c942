"""Host-side integer helpers for launch arithmetic.

`triton.cdiv` and `triton.next_power_of_2` unwrap constexprs on every call: 2.2 us each on the CPU
machine against 0.02 for the integer expressions below, and a decode call makes several. Both
take Python ints (or SymInts for `cdiv`).
"""


def cdiv(a, b):
    """ceil(a / b) for b > 0."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()
