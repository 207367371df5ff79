"""math-verify in worker processes: answers compared as math, a runaway comparison cut off at
its timeout (scoring 0) without the next pair waiting for it, from any thread."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("math_verify")

from tandem.trainers.math_verifier import MathVerifier, equivalent  # noqa: E402

# Each a pair a string match gets wrong: an equal answer written otherwise, or a near miss.
CASES = [
    (r"\frac{1}{2}", "0.5", True), (r"\frac{1}{2}", r"\boxed{1/2}", True),
    ("0.5", r"$\frac{1}{2}$", True), ("1000", "1,000", True), ("1.5", "1.50", True),
    (r"3\sqrt{2}", r"\boxed{\sqrt{18}}", True), ("0.25", r"\boxed{25\%}", True),
    (r"\frac{\pi}{4}", r"\boxed{\pi/4}", True), ("2", r"\boxed{x=2}", True),
    (r"\frac{1}{2}", r"\boxed{2}", False), (r"3\sqrt{2}", r"\boxed{4.2426}", False),
    ("1000", "100", False), ("-7", "7", False), ("12", "no answer", False),
]


@pytest.mark.parametrize("gold, answer, expected", CASES)
def test_answers_compare_as_math(gold, answer, expected):
    assert equivalent(gold, answer) is expected


@pytest.fixture(scope="module")
def verifier():
    verifier = MathVerifier(timeout=2.0)
    yield verifier
    verifier.close()


def test_workers_score_a_batch_as_the_comparison_does(verifier):
    golds, answers, expected = zip(*CASES)
    assert verifier.scores(list(golds), list(answers)) == [float(e) for e in expected]


def test_a_runaway_comparison_scores_zero_at_its_timeout_and_the_others_go_on(verifier):
    start = time.monotonic()
    scores = verifier.scores(["1", "2", r"\frac{1}{2}"],
                             [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{2}", "0.5"])
    assert scores == [0.0, 1.0, 1.0]
    assert time.monotonic() - start < 2.0 + 1.5
    assert verifier.scores(["3"], [r"\boxed{3}"]) == [1.0]  # a fresh worker took its place


def test_scoring_works_off_the_main_thread(verifier):
    results = []
    thread = threading.Thread(target=lambda: results.append(
        verifier.scores([r"\frac{1}{2}", "4"], ["0.5", "5"])))
    thread.start()
    thread.join()
    assert results == [[1.0, 0.0]]


@pytest.mark.parametrize("timeout, workers", [(0.0, 2), (1.0, 0)])
def test_a_timeout_or_worker_count_below_one_is_refused(timeout, workers):
    with pytest.raises(ValueError, match="must be positive"):
        MathVerifier(timeout, workers)
