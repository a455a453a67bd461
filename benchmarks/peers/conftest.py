"""`make peers` counts a skipped adapter test as a failure: a peer that is missing or whose API moved must
stop the comparison, not thin it out in silence."""

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped, which make peers counts as a failure: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped at collection, which make peers counts as a failure: {report.longrepr}"
