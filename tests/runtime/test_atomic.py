"""runtime.atomic's claims: one holder per item, its tag readable by the others, the lock gone after it."""

import threading
import time

from clipseg_sparse.runtime.atomic import claim, claim_tag


def test_a_claim_is_held_once_and_names_its_holder(tmp_path):
    item = tmp_path / "out" / "image"
    with claim(item, "settings-a") as mine:
        assert mine and claim_tag(item) == "settings-a"
        with claim(item, "settings-b") as again:  # another open file: flock refuses it, as another process
            assert not again and claim_tag(item) == "settings-a"
    assert claim_tag(item, patience=0) == "" and not list(item.parent.glob(".*.lock"))  # released, file removed


def test_waiting_for_a_claim_returns_when_its_holder_is_done(tmp_path):
    item = tmp_path / "image"
    order = []

    def holder():
        with claim(item, "a"):
            order.append("held")
            time.sleep(0.3)
            order.append("released")

    thread = threading.Thread(target=holder)
    thread.start()
    while not order:
        time.sleep(0.01)
    with claim(item, "b", wait=True) as mine:
        order.append("waited")
        assert mine and claim_tag(item) == "b"
    thread.join()
    assert order == ["held", "released", "waited"]
