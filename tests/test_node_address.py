"""Workers bind and publish their node's address (realcore.launch.process.node_address)."""

import pytest

from realcore.launch.process import node_address


def test_host_as_given():
    assert node_address("127.0.0.1") == "127.0.0.1"


def test_interface_gives_its_ipv4_address():
    assert node_address("0.0.0.0", "lo") == "127.0.0.1"  # the interface wins over host


def test_unknown_interface_is_one_clear_error():
    with pytest.raises(ValueError, match="system.interface: no network interface 'nope0'"):
        node_address("auto", "nope0")


def test_auto_resolves_to_an_address():
    import ipaddress

    ipaddress.ip_address(node_address("auto"))  # whatever this node resolves to, it is an IP
