"""TLS and addresses: the lighthouse's server context, the workers' client context, and what counts as loopback.

Workers verify the lighthouse's certificate with the CA file given to them
(``ca_file=``, else the ``STALWART_LIGHTHOUSE_CA`` environment variable, else
the system's trust store). A token sent over plain HTTP to another machine
travels in cleartext: the client and the server warn once.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import urllib.parse
from pathlib import Path

log = logging.getLogger(__name__)

CA_ENVIRONMENT = "STALWART_LIGHTHOUSE_CA"
"""Where workers read the CA file that signed the lighthouse's certificate (when ``ca_file`` is not given)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (``localhost``, 127.0.0.0/8, ``::1``); a wildcard is not."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_context(cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> ssl.SSLContext:
    """The lighthouse's TLS context from a PEM certificate (chain) and its private key; errors name the files."""
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if not Path(path).is_file():
            raise ValueError(f"{name} must be a readable PEM file, got {str(path)!r} (no such file)")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(os.fspath(cert), os.fspath(key))
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"cannot load the TLS certificate {cert} and key {key}: {error}") from error
    return context


def client_context(url: str, ca_file: str | os.PathLike[str] | None) -> ssl.SSLContext | None:
    """The context that verifies the lighthouse at ``url`` (None for ``http://``): ``ca_file``, else
    ``STALWART_LIGHTHOUSE_CA``, else the system's trust store."""
    if urllib.parse.urlsplit(url).scheme != "https":
        return None
    ca = ca_file if ca_file is not None else os.environ.get(CA_ENVIRONMENT) or None
    if ca is not None and not Path(ca).is_file():
        raise ValueError(f"ca_file (or {CA_ENVIRONMENT}) must be a readable PEM file, got {str(ca)!r}")
    return ssl.create_default_context(cafile=None if ca is None else os.fspath(ca))


def warn_cleartext(url: str, token: str | None) -> bool:
    """Warn (and return True) when ``token`` would travel unencrypted to another machine at ``url``."""
    parts = urllib.parse.urlsplit(url)
    if token is None or parts.scheme == "https" or is_loopback(parts.hostname or ""):
        return False
    log.warning(
        "the lighthouse token travels in cleartext to %s: anyone on the network can read it; serve the lighthouse "
        "with --tls-cert/--tls-key and use an https:// URL",
        url,
    )
    return True
