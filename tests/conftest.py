"""Suite-wide settings: hypothesis never fails a test for being slow (CI is a loaded 2-core host;
speed is measured by `kvplane bench`, not by tests); the processes tests start (SGLang servers,
tools) run torch on one OpenMP thread unless the environment says otherwise.

Why one thread: on this 2-core host a tiny-model SGLang server with torch's default two OpenMP
threads slows 50-100x as soon as anything else wants a core (OpenMP's spinning workers fight the
other process): the paced-stream e2e test measured 95-180 ms a token beside a ``nice -n 19`` CPU
loop instead of ~1.8 ms, and failed 2 of 5 runs; with ``OMP_NUM_THREADS=1`` it stayed at
1.75-1.84 ms a token and passed 3 of 3 beside the same loop. The tiny models gain nothing from a
second thread, nor do the suite's own in-process tensors (this process reads it too when it
imports torch after this file).

Hypothesis draws some values from the literals of the project's own imported modules ("local
constants", hypothesis >= 6.131). A derandomized test's examples then depend on which modules
the run happened to import and what constants they hold: adding ``* 100`` to a gpu-check tool
changed the stateful core test's draws when another test module imported that tool, and its
coverage counts fell below their floors (``test_core_stateful.py``: 15 prefix rewrites where 33
were drawn alone). Those draws are switched off here, so a derandomized test draws the same
examples whatever else runs beside it (the pinned hypothesis's own constants still apply).
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from sglang_ext.testing.early_starts import EarlyStarts

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _no_local_constants() -> None:
    """Hypothesis' local constants off (module docstring); a hypothesis without them is left as is."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - the pinned hypothesis has it
        return
    empty = getattr(providers, "_local_constants", None)
    if empty is not None and hasattr(providers, "_get_local_constants"):
        frozen = type(empty)()
        providers._kvplane_local_constants = providers._get_local_constants  # for the test's control
        providers._get_local_constants = lambda: frozen


_no_local_constants()

settings.register_profile(
    "kvplane", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("kvplane")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sglang-fresh-launch", action="store_true",
        help="start every SGLang test server as a fresh process (no launch zygote: "
             "tests/sglang/conftest.py's launch_zygote)",
    )


EARLY = pytest.StashKey[EarlyStarts]()


def early_starts_of(config: pytest.Config) -> EarlyStarts:
    """The session's :class:`EarlyStarts` (made on first use, closed when the session ends)."""
    if EARLY not in config.stash:
        config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined] # made here: jobs' mktemp runs on their thread
        early = config.stash[EARLY] = EarlyStarts(dict(os.environ))
        config.add_cleanup(early.close)
    return config.stash[EARLY]


def uses_fixture(items: list[pytest.Item], name: str) -> bool:
    """Whether any of ``items`` (selected tests) requests fixture ``name``."""
    return any(name in getattr(item, "fixturenames", ()) for item in items)


@pytest.fixture(scope="session")
def early_starts(request: pytest.FixtureRequest) -> EarlyStarts:
    """Set-ups the session started at the end of collection (:func:`pytest_collection_finish`)."""
    return early_starts_of(request.config)


@pytest.hookimpl(trylast=True)  # after tests/sglang/conftest.py's: its zygote's wait is the first job
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the slow fresh-process set-ups now, beside the suite's first tests
    (:mod:`sglang_ext.testing.early_starts`): each test module with an ``early_start(early,
    tmp_path_factory, items)`` function (``items``: its selected tests) submits its own, in test
    order."""
    if session.config.option.collectonly or session.testsfailed:  # nothing will run (or collection failed)
        return
    by_module: dict[object, list[pytest.Item]] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "early_start"):
            by_module.setdefault(module, []).append(item)
    factory = session.config._tmp_path_factory  # type: ignore[attr-defined] # the tmp_path_factory fixture's
    for module, items in by_module.items():
        module.early_start(early_starts_of(session.config), factory, items)  # type: ignore[attr-defined]
