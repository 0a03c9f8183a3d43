"""TLS 1.3 for the cross-site transport: one certificate per group, derived from the run's secret.

Every member of a group derives the same Ed25519 key from the group's key (the secret's transport
subkey bound to the group's prefix: run, incarnation, generation, shard; comm/transport.py
`group_key`) with HKDF, and the same self-signed certificate from it (fixed fields; Ed25519
signatures are deterministic, so the DER is identical everywhere). Each side presents it and trusts
it as the only CA, with `CERT_REQUIRED` on both ends (mutual authentication), and the transport
also pins the peer's certificate to it. Nobody without the secret can complete a handshake, and
nobody from another group or incarnation either (another prefix: another key). TLS 1.3 only: ECDHE
(forward secrecy) and AEAD records (confidentiality, integrity, order). No crypto of our own.
Session tickets are off: a connection is never resumed, and nothing is written after the handshake
but the transport's own records.
"""

from __future__ import annotations

import datetime
import os
import ssl
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

LABEL = b"zeroband-tls-v1"
NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zeroband")])
VALID = (datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc),
         datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc))


@dataclass(frozen=True)
class GroupTLS:
    """The contexts of one group: `client` dials, `server` accepts; `cert` is the pinned DER."""

    client: ssl.SSLContext
    server: ssl.SSLContext
    cert: bytes


def group_tls(key: bytes) -> GroupTLS:
    """TLS 1.3 contexts authenticated by `key` (32 bytes of the secret, bound to one group)."""
    private = Ed25519PrivateKey.from_private_bytes(HKDF(hashes.SHA256(), 32, None, LABEL).derive(key))
    cert = (x509.CertificateBuilder().subject_name(NAME).issuer_name(NAME).public_key(private.public_key())
            .serial_number(1).not_valid_before(VALID[0]).not_valid_after(VALID[1]).sign(private, None))
    der = cert.public_bytes(serialization.Encoding.DER)
    pem = cert.public_bytes(serialization.Encoding.PEM) + private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    client, server = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    fd = os.memfd_create("zeroband-tls", os.MFD_CLOEXEC)  # the key never touches a file system
    try:
        os.write(fd, pem)
        for ctx in (client, server):
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.check_hostname = False  # the identity is the pinned certificate, not a name
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.options |= ssl.OP_NO_TICKET
            ctx.load_verify_locations(cadata=der)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    server.num_tickets = 0
    return GroupTLS(client, server, der)
