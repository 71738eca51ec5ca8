"""Per-request draft length: shrinks while drafts are rejected, grows back when all are accepted,
stays within 1..k, and is forgotten with the request."""

from tessera.worker.spec_decode.draft_length import DraftLength


def test_draft_length_follows_acceptance():
    dl = DraftLength(6)
    assert dl.limit("a") == 6
    for expected in (5, 4, 3, 2, 1, 1):
        dl.update("a", dl.limit("a"), 0)
        assert dl.limit("a") == expected
    dl.update("a", 1, 1)
    assert dl.limit("a") == 3
    dl.update("a", 3, 3)
    dl.update("a", 5, 5)
    assert dl.limit("a") == 6 and dl.limit("b") == 6
    dl.update("a", 2, 1)  # cut short by the scheduler, one rejected
    assert dl.limit("a") == 5
    dl.forget(["a"])
    assert dl.limit("a") == 6
