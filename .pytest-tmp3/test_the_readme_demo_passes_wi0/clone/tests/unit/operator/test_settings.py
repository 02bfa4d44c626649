"""Operator settings come from TRAININGRUN_* variables; a bad value names the variable."""

import dataclasses

import pytest

from trainingrun_operator.settings import Settings


def test_defaults_and_environment():
    from_env = Settings.from_env({})
    assert dataclasses.replace(from_env, signing_key=b"") == Settings()
    assert len(from_env.signing_key) == 32 and from_env.signing_key != Settings.from_env({}).signing_key  # random
    settings = Settings.from_env(
        {
            "TRAININGRUN_NAMESPACES": "team-a, team-b,",
            "TRAININGRUN_PEERING": "trainingrun-operator",
            "TRAININGRUN_OPERATOR_METRICS_PORT": "0",
            "TRAININGRUN_RECONCILE_INTERVAL_SECONDS": "2.5",
            "TRAININGRUN_KEEP_FAILED_ATTEMPTS": "3",
        }
    )
    assert settings.namespaces == ("team-a", "team-b") and settings.peering == "trainingrun-operator"
    assert settings.metrics_port == 0 and settings.reconcile_interval_seconds == 2.5
    assert settings.keep_failed_attempts == 3


def test_the_signing_key_comes_from_the_report_endpoints_private_key(tmp_path):
    """Every replica mounts the same Secret: the same key, which a restart keeps too; never shown."""
    (tmp_path / "tls.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\nabc\n-----END PRIVATE KEY-----\n")
    first = Settings.from_env({"TRAININGRUN_REPORT_TLS_DIR": str(tmp_path)})
    second = Settings.from_env({"TRAININGRUN_REPORT_TLS_DIR": str(tmp_path)})
    assert first.signing_key == second.signing_key and len(first.signing_key) == 32
    assert b"abc" not in first.signing_key and repr(first.signing_key) not in repr(first)


def test_the_report_service_needs_the_pods_ip():
    settings = Settings.from_env(
        {
            "TRAININGRUN_REPORT_SERVICE": "ops/tr-report",
            "TRAININGRUN_OPERATOR_POD_IP": "fd00::7",
            "TRAININGRUN_OPERATOR_POD_NAME": "op-1",
        }
    )
    assert (settings.report_service, settings.pod_ip, settings.pod_name) == ("ops/tr-report", "fd00::7", "op-1")
    with pytest.raises(ValueError, match="TRAININGRUN_OPERATOR_POD_IP='' is not an IP address.*status.podIP"):
        Settings.from_env({"TRAININGRUN_REPORT_SERVICE": "ops/tr-report"})
    with pytest.raises(ValueError, match="TRAININGRUN_REPORT_SERVICE='tr-report' must be namespace/name"):
        Settings.from_env({"TRAININGRUN_REPORT_SERVICE": "tr-report", "TRAININGRUN_OPERATOR_POD_IP": "10.0.0.1"})


def test_a_bad_number_names_the_variable():
    with pytest.raises(ValueError, match="TRAININGRUN_OPERATOR_METRICS_PORT='nine' is not a whole number"):
        Settings.from_env({"TRAININGRUN_OPERATOR_METRICS_PORT": "nine"})


@pytest.mark.parametrize("name", ["TRAININGRUN_API_REQUESTS_IN_FLIGHT", "TRAININGRUN_RECONCILE_WORKERS"])
def test_concurrency_of_at_least_one(name):
    assert getattr(Settings.from_env({name: "3"}), name.removeprefix("TRAININGRUN_").lower()) == 3
    with pytest.raises(ValueError, match=f"{name}='0' must be at least 1"):
        Settings.from_env({name: "0"})


def test_a_peering_record_outlives_its_renewal():
    assert Settings.from_env({}).peering_lifetime_seconds == 6
    assert Settings.from_env({"TRAININGRUN_PEERING_LIFETIME_SECONDS": "15"}).peering_lifetime_seconds == 15
    with pytest.raises(ValueError, match="TRAININGRUN_PEERING_LIFETIME_SECONDS='1' must be at least 2"):
        Settings.from_env({"TRAININGRUN_PEERING_LIFETIME_SECONDS": "1"})


@pytest.mark.parametrize("name", ["TRAININGRUN_RECONCILE_INTERVAL_SECONDS", "TRAININGRUN_RESYNC_SECONDS"])
def test_intervals_are_more_than_nothing(name):
    assert getattr(Settings.from_env({name: "2.5"}), name.removeprefix("TRAININGRUN_").lower()) == 2.5
    with pytest.raises(ValueError, match=f"{name}='0' must be more than 0 seconds"):
        Settings.from_env({name: "0"})


def test_cli_flags_override_the_environment(monkeypatch):
    import trainingrun_operator.handlers as handlers
    from trainingrun_operator import cli

    seen = {}

    async def fake_run_operator(state, **_):
        seen["settings"] = state.settings

    monkeypatch.setattr(handlers, "run_operator", fake_run_operator)  # the kopf loop itself is tested against kmock
    monkeypatch.setenv("TRAININGRUN_NAMESPACES", "from-env")
    assert cli.main(["operator", "-n", "a", "-n", "b", "--peering", "ha", "--metrics-port", "0"]) == 0
    assert seen["settings"].namespaces == ("a", "b") and seen["settings"].peering == "ha"
    assert seen["settings"].metrics_port == 0
    assert cli.main(["operator", "-A", "--standalone"]) == 0
    assert seen["settings"].namespaces == () and seen["settings"].peering == ""


def test_the_report_endpoints_limits_come_from_the_environment_with_report_limits_defaults():
    from trainingrun_operator.report_connections import ReportLimits

    assert Settings().report_limits() == ReportLimits()
    limits = Settings.from_env(
        {
            "TRAININGRUN_REPORT_IDLE_TIMEOUT_SECONDS": "3.5",
            "TRAININGRUN_REPORT_BODY_MIN_BYTES_PER_SECOND": "100",
            "TRAININGRUN_REPORT_MAX_CONNECTIONS": "7",
            "TRAININGRUN_REPORT_MAX_CONNECTIONS_PER_ADDRESS": "2",
        }
    ).report_limits()
    assert limits == ReportLimits(3.5, 100.0, 7, 2)
    assert limits.body_seconds(1000) == 3.5 + 10.0
    for name in ("TRAININGRUN_REPORT_MAX_CONNECTIONS", "TRAININGRUN_REPORT_MAX_CONNECTIONS_PER_ADDRESS"):
        with pytest.raises(ValueError, match=f"{name}='0' must be at least 1"):
            Settings.from_env({name: "0"})
    with pytest.raises(ValueError, match="TRAININGRUN_REPORT_IDLE_TIMEOUT_SECONDS='0' must be more than 0"):
        Settings.from_env({"TRAININGRUN_REPORT_IDLE_TIMEOUT_SECONDS": "0"})
