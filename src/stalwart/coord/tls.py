"""TLS, addresses and secret files: the lighthouse's server context, the workers' client context, what counts as
loopback, and the check that a key or token file is its owner's alone.

Workers verify the lighthouse's certificate with the CA file given to them
(``ca_file=``, else the ``STALWART_LIGHTHOUSE_CA`` environment variable, else
the system's trust store). A token sent over plain HTTP to another machine
travels in cleartext: the client warns once (the server refuses such a bind
unless told ``insecure``). A private key or token file that its group or
others may read or write is refused, as ssh refuses such a key.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import ssl
import stat
import urllib.parse
from pathlib import Path

from stalwart.errors import StalwartError

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


@functools.lru_cache(maxsize=256)
def is_loopback_authority(authority: str) -> bool:
    """Whether a ``Host`` header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``) names this machine only.

    Cached (a lighthouse reads it on every request without a token, and its members send the same few values).

    What a browser under DNS rebinding sends is the attacker's name: it is not loopback, whatever address it
    resolved to.
    """
    if authority.startswith("["):
        host, bracket, rest = authority[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
        return ":" in host and is_loopback(host)
    host, colon, port = authority.partition(":")
    if colon and not port.isdigit():
        return False
    return is_loopback(host) and ":" not in host


def is_loopback_origin(origin: str) -> bool:
    """Whether an ``Origin`` header is a page served from this machine (``http(s)://`` and a loopback host)."""
    scheme, separator, authority = origin.partition("://")
    return bool(separator) and scheme.lower() in ("http", "https") and is_loopback_authority(authority)


class ExposedSecretError(StalwartError, ValueError):
    """A private key or token file that its group or others may read or write (the message says the fix)."""


def check_private(path: str | os.PathLike[str], what: str) -> None:
    """Refuse ``path`` (``what``: its option, e.g. ``--token-file``) when its mode gives its group or others any
    access, naming the file, its mode and the fix: :class:`ExposedSecretError`."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise ExposedSecretError(
            f"{what} {os.fspath(path)} may be read by its group or others (mode {mode:04o}): it is a secret; run "
            f"chmod 600 {os.fspath(path)}"
        )


def server_context(cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> ssl.SSLContext:
    """The lighthouse's TLS context from a PEM certificate (chain) and its private key; errors name the files.

    A key its group or others may read is refused (:func:`check_private`).
    """
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if not Path(path).is_file():
            raise ValueError(f"{name} must be a readable PEM file, got {str(path)!r} (no such file)")
    check_private(key, "tls_key (--tls-key)")
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
