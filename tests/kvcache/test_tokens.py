from array import array

from hypothesis import given, strategies as st

from kvcache.tokens import as_token_array, common_prefix_tokens

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=12)


@given(tokens, tokens)
def test_common_prefix_equals_the_naive_count(a, b):
    naive = 0
    for x, y in zip(a, b):
        if x != y:
            break
        naive += 1
    assert common_prefix_tokens(array("I", a).tobytes(), array("I", b).tobytes()) == naive


def test_token_arrays_pass_through_unchanged():
    arr = array("I", [1, 2, 3])
    assert as_token_array(arr) is arr
    assert as_token_array([1, 2, 3]) == arr
