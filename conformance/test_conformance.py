"""The suite as collected by `pytest --pyargs conformance`: runs against the adapter given by
--adapter / --trainer-cmd (or the ini options), else the bundled reference trainer."""
from conformance.suite import ResumeConformance


class TestConformance(ResumeConformance):
    configured_by_options = True
