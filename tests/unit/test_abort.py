"""Aborting a gloo group's waits (megatron_refit.transport.abort), on real sockets in one process."""

from __future__ import annotations

import socket

from megatron_refit.transport.abort import LISTENER, GlooSockets


class _Store:
    def __init__(self, values):
        self.values = values

    def get(self, key):
        return self.values[key].encode()


def _listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_group_owns_the_sockets_on_its_listener_and_to_its_peers_listeners_and_no_other():
    mine, peer, other = _listener(), _listener(), _listener()
    accepted_from = socket.create_connection(mine.getsockname())  # a peer connected to this rank's listener
    accepted, _ = mine.accept()
    to_peer = socket.create_connection(peer.getsockname())  # this rank connected to a peer's listener
    at_peer, _ = peer.accept()
    unrelated = socket.create_connection(other.getsockname())  # another group's pair
    at_other, _ = other.accept()
    group = GlooSockets()
    host, port = peer.getsockname()
    group.find(_Store({f"{LISTENER}/1": f"{host} {port}"}), 0, 2, mine.getsockname())
    owned = set(group._owned)
    assert owned == {accepted.fileno(), to_peer.fileno()}, (owned, accepted.fileno(), to_peer.fileno())
    assert group.shutdown() == 2
    for far in (accepted_from, at_peer):  # each far end sees the connection closed at once
        far.settimeout(2)
        assert far.recv(1) == b""
    unrelated.sendall(b"x")
    at_other.settimeout(2)
    assert at_other.recv(1) == b"x"  # untouched
    assert group.shutdown() == 0  # once
    for sock in (mine, peer, other, accepted_from, accepted, to_peer, at_peer, unrelated, at_other):
        sock.close()


def test_a_descriptor_closed_and_reused_meanwhile_is_not_touched():
    mine = _listener()
    client = socket.create_connection(mine.getsockname())
    accepted, _ = mine.accept()
    group = GlooSockets()
    group.find(_Store({}), 0, 1, mine.getsockname())
    fd = accepted.fileno()
    assert set(group._owned) == {fd}
    accepted.close()
    client.close()
    reuse_listener = _listener()  # likely takes the freed number
    again = socket.create_connection(reuse_listener.getsockname())
    far, _ = reuse_listener.accept()
    assert group.shutdown() == 0  # its inode changed: left alone
    again.sendall(b"y")
    far.settimeout(2)
    assert far.recv(1) == b"y"
    for sock in (mine, reuse_listener, again, far):
        sock.close()
