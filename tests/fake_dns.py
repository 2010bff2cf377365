"""A DNS server on a loopback UDP port that answers A queries for one name from a list the test
changes, so a gRPC `dns://127.0.0.1:PORT/name:port` target resolves the way a headless Kubernetes
Service does when pods come and go (every answer has TTL 0)."""

from __future__ import annotations

import socket
import struct
import threading

_TYPE_A = 1
_CLASS_IN = 1


class FakeDns:
    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name = name.lower().rstrip(".")
        self.addresses = list(addresses)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.num_queries = 0
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="fake-dns", daemon=True)
        self._thread.start()

    def target(self, port: int) -> str:
        return f"dns://127.0.0.1:{self.port}/{self.name}:{port}"

    def close(self) -> None:
        """Stops the server's thread, then closes its socket. (Closing the socket alone would not wake the
        thread's `recvfrom`: on Linux it waits on, so a datagram to itself wakes it.)"""
        self._closing = True
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as waker:
            waker.sendto(b"", ("127.0.0.1", self.port))
        self._thread.join()
        self._socket.close()

    def _serve(self) -> None:
        while True:
            query, peer = self._socket.recvfrom(512)
            if self._closing:
                return
            self.num_queries += 1
            self._socket.sendto(self._answer(query), peer)

    def _answer(self, query: bytes) -> bytes:
        """NOERROR with one A record per address for our name and type A; NOERROR and no records for
        its other types (AAAA); NXDOMAIN for other names."""
        (query_id,) = struct.unpack(">H", query[:2])
        offset, labels = 12, []
        while query[offset]:
            length = query[offset]
            labels.append(query[offset + 1 : offset + 1 + length].decode().lower())
            offset += length + 1
        qtype, _ = struct.unpack(">HH", query[offset + 1 : offset + 5])
        question = query[12 : offset + 5]
        ours = ".".join(labels) == self.name
        records = b""
        addresses = list(self.addresses) if ours and qtype == _TYPE_A else []
        for address in addresses:
            # Name: a pointer to the question's name at offset 12; TTL 0; 4 bytes of address.
            records += (
                b"\xc0\x0c" + struct.pack(">HHIH", _TYPE_A, _CLASS_IN, 0, 4) + socket.inet_aton(address)
            )
        flags = 0x8180 | (0 if ours else 3)  # response, recursion desired and available; rcode
        header = struct.pack(">HHHHHH", query_id, flags, 1, len(addresses), 0, 0)
        return header + question + records
