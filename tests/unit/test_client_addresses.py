"""Which address a failed authentication counts against: the peer's, or the client a trusted proxy names."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from dpd_router.api.auth import ClientAddresses
from dpd_router.config import SettingsError, load_settings


def request_from(peer: str, *forwarded_for: str) -> Request:
    headers = [(b"x-forwarded-for", value.encode()) for value in forwarded_for]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "client": (peer, 5000)})


@pytest.mark.parametrize(
    ("trusted", "peer", "forwarded_for", "source"),
    [
        # No trusted proxy: the header is anyone's to write, so it is ignored.
        ([], "10.0.0.5", ["203.0.113.9"], "10.0.0.5"),
        # A peer that is not a trusted proxy is the client, whatever it forwards.
        (["10.0.0.0/8"], "192.0.2.1", ["203.0.113.9"], "192.0.2.1"),
        # The ingress appends the address it was reached from: that is the client.
        (["10.0.0.0/8"], "10.0.0.5", ["203.0.113.9"], "203.0.113.9"),
        # A client's own entries stand left of it and are not believed.
        (["10.0.0.0/8"], "10.0.0.5", ["198.51.100.1, 203.0.113.9"], "203.0.113.9"),
        # A chain of trusted proxies is walked through; several header lines read as one list.
        (["10.0.0.0/8", "172.16.0.1"], "10.0.0.5", ["198.51.100.1", "203.0.113.9, 172.16.0.1"], "203.0.113.9"),
        # A trusted peer that forwards nothing usable is the source itself.
        (["10.0.0.0/8"], "10.0.0.5", [], "10.0.0.5"),
        (["10.0.0.0/8"], "10.0.0.5", ["10.0.0.7"], "10.0.0.5"),
        (["::1"], "::1", ["2001:db8::2"], "2001:db8::2"),
        # Whatever is not an address (garbage, 'unknown') is taken as the client: it counts, never passes.
        (["10.0.0.0/8"], "10.0.0.5", ["not-an-address"], "not-an-address"),
    ],
)
def test_the_source_of_a_request(trusted: list[str], peer: str, forwarded_for: list[str], source: str) -> None:
    assert ClientAddresses(trusted).source_of(request_from(peer, *forwarded_for)) == source


def test_trusted_proxies_are_read_from_a_comma_list_and_checked() -> None:
    settings = load_settings(decode_urls=["http://127.0.0.1:9000"], trusted_proxies="10.0.0.0/8, 192.0.2.1")
    assert settings.trusted_proxies == ["10.0.0.0/8", "192.0.2.1"]
    with pytest.raises(SettingsError, match="trusted_proxies"):
        load_settings(decode_urls=["http://127.0.0.1:9000"], trusted_proxies=["10.0.0.300/8"])
