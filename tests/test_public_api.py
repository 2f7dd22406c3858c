"""The public surface: names exported, sync and async twins, the error tree."""

from __future__ import annotations

import inspect

import amqp_locks
from amqp_locks import aio, errors


def test_sync_exports() -> None:
    assert set(amqp_locks.__all__) == {
        "DEFAULT_URL",
        "HOLDER_ID_ARGUMENT",
        "redact_url",
        "Connection",
        "Consuming",
        "Lease",
        "Mutex",
        "PressureQueue",
        "Producing",
        "Semaphore",
        "SemaphoreAdmin",
        "__version__",
        "errors",
    }
    assert amqp_locks.Semaphore.__module__ == "amqp_locks"


def test_async_face_has_the_same_classes_with_awaitable_methods() -> None:
    shared = {"__version__", "DEFAULT_URL", "HOLDER_ID_ARGUMENT", "redact_url"}
    assert set(aio.__all__) == set(amqp_locks.__all__) - shared
    for name in ("SemaphoreAdmin",):
        sync_cls, async_cls = getattr(amqp_locks, name), getattr(aio, name)
        public = {m for m in vars(sync_cls) if not m.startswith("_")}
        assert public <= set(vars(async_cls))
        for method in public - {"name"}:
            assert inspect.iscoroutinefunction(getattr(async_cls, method)), method
    for method in ("try_acquire", "close"):
        assert inspect.iscoroutinefunction(getattr(aio.Semaphore, method))
    for method in ("release", "verify"):
        assert inspect.iscoroutinefunction(getattr(aio.Lease, method))
    assert aio.Semaphore.__module__ == "amqp_locks.aio"


def test_async_pressure_queue_twins_the_sync_one() -> None:
    for name in ("PressureQueue", "Producing", "Consuming"):
        sync_cls, async_cls = getattr(amqp_locks, name), getattr(aio, name)
        public = {m for m in vars(sync_cls) if not m.startswith("_")}
        assert public <= set(vars(async_cls)), public - set(vars(async_cls))
        assert async_cls.__module__ == "amqp_locks.aio"
    for method in ("create", "exists", "length", "put", "get", "close", "delete", "stats"):
        assert inspect.iscoroutinefunction(getattr(aio.PressureQueue, method)), method


def test_every_error_is_an_amqp_locks_error_with_a_docstring() -> None:
    classes = [
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == errors.__name__
    ]
    assert set(errors.__all__) == {cls.__name__ for cls in classes}
    for cls in classes:
        assert issubclass(cls, errors.AmqpLocksError)
        assert cls.__doc__


def test_error_kinds_are_also_the_builtin_kinds_users_catch() -> None:
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.InvalidNameError, ValueError)
    assert issubclass(errors.AcquireTimeoutError, TimeoutError)
    assert issubclass(errors.ReleaseTimeoutError, TimeoutError)
    assert issubclass(errors.BrokerTimeoutError, TimeoutError)
    assert issubclass(errors.BrokerUnavailableError, errors.BrokerError)
    assert issubclass(errors.OperationTimeoutError, TimeoutError)
    for cls in (
        errors.QueueDoesNotExistError,
        errors.QueueAlreadyExistsError,
        errors.QueueInUseError,
        errors.QueueFullError,
        errors.QueueClosedError,
        errors.OperationTimeoutError,
    ):
        assert issubclass(cls, errors.PressureError)


def test_redact_url_masks_only_the_password() -> None:
    assert amqp_locks.redact_url("amqp://u:s%40cret@h:5672/%2F") == "amqp://u:***@h:5672/%2F"
    assert amqp_locks.redact_url("amqp://h/%2F") == "amqp://h/%2F"
