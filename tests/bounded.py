"""A call that must end within a deadline: a test of a watchdog fails, instead of hanging the
suite, when the watchdog is missing."""
import threading

import pytest


def returns_within(seconds: float, fn, *args, **kwargs):
    """fn(*args, **kwargs) run in a daemon thread: its result, or its exception raised here; a
    test failure when it has not ended after `seconds` (the thread is left behind)."""
    outcome = {}

    def call():
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (raised again in the test's thread)
            outcome["error"] = e
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {seconds:g} s: it hangs")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")
