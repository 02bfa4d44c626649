"""Test certificates: a CA and a server certificate signed by it, as the operator's report endpoint reads them."""

from __future__ import annotations

import datetime


def certificate(directory, host="127.0.0.1", key="ecdsa"):
    """A CA and a certificate for `host` (an IP address or a DNS name) signed by it, as tls.crt, tls.key and ca.crt;
    `key`: "ecdsa" (P-256, as the chart makes them) or "rsa" (2048 bits, as the chart's genCA made them)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    def new_key():
        return rsa.generate_private_key(65537, 2048) if key == "rsa" else ec.generate_private_key(ec.SECP256R1())

    try:
        name = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        name = x509.DNSName(host)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, leaf_key = new_key(), new_key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test report CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([name]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "tls.crt").write_bytes(cert.public_bytes(pem))
    (directory / "tls.key").write_bytes(
        leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return directory
