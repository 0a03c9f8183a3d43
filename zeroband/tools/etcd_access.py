"""etcd's own access control for a multi-site run: TLS certificates, and a user whose role may read
and write the run's prefix only (README, "Multi-site runs on etcd").

    python -m zeroband.tools.etcd_access certs --out etcd-tls --hosts 10.0.0.1,10.0.0.2,10.0.0.3
    python -m zeroband.tools.etcd_access users --endpoint https://10.0.0.1:2379 --tls etcd-tls \\
        --prefix zeroband-run1 --user run1 --password-file run1.password --root-password-file root.password

`certs` writes a CA, one server/peer certificate for every member host and a client certificate
(`client.pem`, `client-key.pem`: what every site presents). `users` adds `root` and the run's user,
grants that user's role readwrite on `<prefix>/` only, and enables authentication. etcd's
gRPC gateway (the HTTP API zeroband's client speaks) does not map a certificate's name to a user,
so sites present the client certificate (TLS) and authenticate as the run's user (a password).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import ipaddress
import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DAYS = 3650


@dataclass(frozen=True)
class TlsFiles:
    """Where `make_certs` wrote its files (all PEM)."""

    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def server(self) -> tuple[Path, Path]:
        return self.root / "server.pem", self.root / "server-key.pem"

    @property
    def client(self) -> tuple[Path, Path]:
        return self.root / "client.pem", self.root / "client-key.pem"

    @property
    def jwt(self) -> tuple[Path, Path]:
        """The key pair the members sign and check auth tokens with (`jwt_flag`)."""
        return self.root / "jwt-pub.pem", self.root / "jwt-key.pem"

    def jwt_flag(self) -> str:
        """etcd's --auth-token: JWT, so a token holds on every member, restarted ones included (etcd's
        default "simple" tokens live in each member's memory; a restarted member refuses them)."""
        public, private = self.jwt
        return f"jwt,pub-key={public},priv-key={private},sign-method=ES256,ttl=1h"


def make_certs(out: Path, hosts: list[str]) -> TlsFiles:
    """A fresh CA and, signed by it, a server certificate valid for `hosts` (and localhost) and a
    client certificate. Keys are written mode 0600."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(_name("zeroband etcd CA"), ca_key, ca_key, _name("zeroband etcd CA"), ca=True)
    names = [_san(h) for h in dict.fromkeys([*hosts, "127.0.0.1", "localhost"])]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # members are peers' clients too
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert(_name("zeroband etcd member"), server_key, ca_key, ca.subject, names=names, usage=usage)
    client_key = ec.generate_private_key(ec.SECP256R1())
    # no CommonName: etcd's gateway refuses every request whose client certificate has one (it cannot
    # map it to a user, and says so rather than ignore it); an organisation names it instead
    client = _cert(_name("zeroband site", NameOID.ORGANIZATION_NAME), client_key, ca_key, ca.subject, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    files = TlsFiles(out)
    _write(files.ca, ca, None)
    _write(files.server[0], server, server_key)
    _write(files.client[0], client, client_key)
    _write(out / "ca-key.pem", None, ca_key)  # kept to sign more certificates; sites never need it
    jwt_key = ec.generate_private_key(ec.SECP256R1())
    _write(files.jwt[1], None, jwt_key)
    files.jwt[0].write_bytes(jwt_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                               serialization.PublicFormat.SubjectPublicKeyInfo))
    return files


def _name(value: str, oid=None):  # cryptography's Name (default: a CommonName)
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(oid or NameOID.COMMON_NAME, value)])


def _san(host: str):  # an x509 GeneralName
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _cert(subject, key, signer, issuer, ca: bool = False, names=None, usage=None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(path: Path, cert, key) -> None:
    from cryptography.hazmat.primitives import serialization

    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        key_path = path if cert is None else path.with_name(path.name.replace(".pem", "-key.pem"))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def prefix_range(prefix: str) -> tuple[str, str]:
    """(key, range_end) of every etcd key under `<prefix>/` (base64, as the HTTP API takes them)."""
    start = prefix.strip("/") + "/"
    return _b64(start), _b64(start[:-1] + chr(ord(start[-1]) + 1))


def call(endpoint: str, path: str, body: dict, tls: TlsFiles, token: str | None = None) -> dict:
    """One request to etcd's HTTP API over TLS with the client certificate."""
    context = ssl.create_default_context(cafile=str(tls.ca))
    context.load_cert_chain(*(str(p) for p in tls.client))
    request = urllib.request.Request(f"{endpoint}/v3/{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": token} if token else {})
    with urllib.request.urlopen(request, timeout=10, context=context) as reply:
        return json.loads(reply.read())


def add_run_user(endpoint: str, tls: TlsFiles, prefix: str, user: str, password: str, root_password: str) -> None:
    """`root` (etcd requires it before auth is enabled) and `user`, whose role `<user>-rw` may read and
    write keys under `<prefix>/` only; then authentication on. With auth already on, only the run's
    user and role are added (as root)."""
    status = call(endpoint, "auth/authenticate", {"name": "root", "password": root_password}, tls) \
        if _auth_enabled(endpoint, tls) else {}
    token = status.get("token")
    if token is None:
        call(endpoint, "auth/user/add", {"name": "root", "password": root_password}, tls)
        call(endpoint, "auth/user/grant", {"user": "root", "role": "root"}, tls)
    key, end = prefix_range(prefix)
    role = f"{user}-rw"
    call(endpoint, "auth/role/add", {"name": role}, tls, token)
    call(endpoint, "auth/role/grant", {"name": role, "perm": {"permType": "READWRITE", "key": key, "range_end": end}},
         tls, token)
    call(endpoint, "auth/user/add", {"name": user, "password": password}, tls, token)
    call(endpoint, "auth/user/grant", {"user": user, "role": role}, tls, token)
    if token is None:
        call(endpoint, "auth/enable", {}, tls)


def _auth_enabled(endpoint: str, tls: TlsFiles) -> bool:
    try:
        call(endpoint, "auth/user/list", {}, tls)
        return False
    except urllib.error.HTTPError:
        return True  # refused without a token: authentication is on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    certs = sub.add_parser("certs", help="write a CA, a member certificate and a client certificate")
    certs.add_argument("--out", type=Path, required=True)
    certs.add_argument("--hosts", required=True, help="comma-separated addresses or names of the etcd members")
    users = sub.add_parser("users", help="add root and the run's user (readwrite on its prefix), enable auth")
    users.add_argument("--endpoint", required=True, help="https://host:port of one member")
    users.add_argument("--tls", type=Path, required=True, help="the directory `certs` wrote")
    users.add_argument("--prefix", required=True, help="the run's etcd prefix (the /path of sites.store)")
    users.add_argument("--user", required=True)
    users.add_argument("--password-file", type=Path, required=True)
    users.add_argument("--root-password-file", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "certs":
        files = make_certs(args.out, [h.strip() for h in args.hosts.split(",") if h.strip()])
        print(f"wrote {files.ca}, {files.server[0]}, {files.client[0]} (and their keys) under {args.out}")
        return 0
    add_run_user(args.endpoint.rstrip("/"), TlsFiles(args.tls), args.prefix, args.user,
                 args.password_file.read_text().strip(), args.root_password_file.read_text().strip())
    print(f"user {args.user!r} may read and write {args.prefix.strip('/')}/ only; authentication is on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
