"""tests/hlo_checks.py: an int8 product is an s8 x s8 -> s32 dot, nothing less."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tests.hlo_checks import float_dot_widths, int8_dots

A = jnp.ones((8, 64), jnp.int8)
B = jnp.ones((64, 32), jnp.int8)


def compiled(fn) -> str:
    return jax.jit(fn).lower(A, B).compile().as_text()


def test_a_real_int8_product_is_found():
    hlo = compiled(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32))
    assert len(int8_dots(hlo)) == 1


def test_int8_values_converted_to_float_are_not_an_int8_product():
    hlo = compiled(lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32))
    assert "s8[" in hlo  # the parameters are int8 ...
    assert not int8_dots(hlo)  # ... the product is float


def test_int8_values_widened_to_int32_are_not_an_int8_product():
    hlo = compiled(lambda a, b: a.astype(jnp.int32) @ b.astype(jnp.int32))
    assert "s8[" in hlo and "s32[" in hlo  # what the loose check accepted
    assert not int8_dots(hlo)


def test_operand_types_written_inline_are_read_too():
    hlo = ("ENTRY %main (a: s8[4,4], b: f32[4,4]) -> s32[4,4] {\n"
           "  %a = s8[4,4]{1,0} parameter(0)\n"
           "  %c = f32[4,4]{1,0} convert(%a)\n"
           "  %d = s32[4,4]{1,0} dot(s8[4,4]{1,0} %a, s8[4,4]{1,0} %a), lhs_contracting_dims={1}\n"
           "  ROOT %e = s32[4,4]{1,0} dot(%c, %a), lhs_contracting_dims={1}\n}\n")
    assert [line.split(" =")[0] for line in int8_dots(hlo)] == ["%d"]


def test_float_dot_widths_are_the_contracted_lengths():
    hlo = compiled(lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32))
    assert float_dot_widths(hlo) == [64]
    assert float_dot_widths(compiled(
        lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32))) == []
