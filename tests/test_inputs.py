import pytest

from tessera.inputs import InvalidTokenIdError, check_token_ids


def test_accepts_token_ids_in_range():
    check_token_ids([0, 5, 9], 10, "prompt_token_ids")
    check_token_ids([], 10, "prompt_token_ids")  # empty: the caller's own error


@pytest.mark.parametrize("bad", [10, -1, True, 1.0, "3", None])
def test_rejects_and_names_the_field(bad):
    with pytest.raises(
        ValueError, match=r"prompt_token_ids: .* is not a token id in \[0, 10\)"
    ) as e:
        check_token_ids([1, bad, 2], 10, "prompt_token_ids")
    assert isinstance(e.value, InvalidTokenIdError)
    assert e.value.token_id is bad
