"""A throwaway PKI for TLS tests: a CA and certificates it signs (IP and DNS names)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_pki(directory: Path, name: str = "cluster", hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict:
    """Write `<name>-ca.pem`, `<name>-cert.pem`, `<name>-key.pem` (one certificate for every engine,
    server and client use, valid for `hosts`); returns the kv_transfer.tls fields."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{name} test CA"))
        .issuer_name(_name(f"{name} test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{name} engine"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {
        "ca_file": directory / f"{name}-ca.pem",
        "cert_file": directory / f"{name}-cert.pem",
        "key_file": directory / f"{name}-key.pem",
    }
    paths["ca_file"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert_file"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key_file"].write_bytes(_pem_key(key))
    paths["key_file"].chmod(0o600)
    return {k: str(v) for k, v in paths.items()}
