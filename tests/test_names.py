"""Semaphore names map injectively to queue names; bad names fail at construction."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from amqp_locks import Semaphore, SemaphoreAdmin, errors
from amqp_locks._naming import SemaphoreNames


def test_queue_names_follow_the_spec_shape() -> None:
    names = SemaphoreNames.of("reports")
    assert names.admin == "reports"
    assert names.slot(1) == "reports-1-A"
    assert names.holder(12) == "reports-12-B"
    assert names.wake == "reports-0-W"


def test_namespace_is_a_plain_prefix() -> None:
    assert SemaphoreNames.of("jobs", "team.").slot(2) == "team.jobs-2-A"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "amq.reports",
        "x-1-A",
        "x-12-B",
        "x-0-W",
        "bad\nname",
        "n" * 250,
        "é" * 125,
    ],
)
def test_invalid_names_are_rejected_before_any_io(bad: str) -> None:
    with pytest.raises(errors.InvalidNameError):
        Semaphore(bad, url="amqp://nowhere.invalid:1/")
    with pytest.raises(errors.InvalidNameError):
        SemaphoreAdmin(bad, url="amqp://nowhere.invalid:1/")


@pytest.mark.parametrize("bad", [None, 3, b"bytes", ["x"]])
def test_names_of_wrong_type_are_invalid_names(bad: object) -> None:
    with pytest.raises(errors.InvalidNameError):
        Semaphore(bad, url="amqp://nowhere.invalid:1/")  # type: ignore[arg-type]


def test_invalid_name_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="reserves"):
        SemaphoreNames.of("amq.x")


def test_namespace_counts_towards_the_length_and_the_amq_prefix() -> None:
    with pytest.raises(errors.InvalidNameError):
        SemaphoreNames.of("x", "amq.")
    with pytest.raises(errors.InvalidNameError):
        SemaphoreNames.of("x", "n" * 250)


def test_names_ending_like_digits_then_lowercase_are_fine() -> None:
    assert SemaphoreNames.of("job-2024-a").admin == "job-2024-a"


_name = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters="\x7f"),
    min_size=1,
    max_size=30,
)


@given(_name, _name, st.integers(1, 500), st.integers(1, 500))
def test_no_queue_of_one_semaphore_is_a_queue_of_another(a: str, b: str, i: int, j: int) -> None:
    try:
        x, y = SemaphoreNames.of(a), SemaphoreNames.of(b)
    except errors.InvalidNameError:
        return
    queues_x = {x.admin, x.wake, x.slot(i), x.holder(i)}
    queues_y = {y.admin, y.wake, y.slot(j), y.holder(j)}
    if a != b:
        assert not queues_x & queues_y
    assert len(queues_x) == 4
