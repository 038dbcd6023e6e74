# The Python environment and the non-root user of every image, right after its system packages (if any).
# Copied into docker/*/Dockerfile by scripts/render_dockerfiles.py (`make dockerfiles`); this header, up to the
# first blank line, is not copied.

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# "python3" is /usr/local/bin/python3 in the official image and Debian's /usr/bin/python3 in the local
# stand-in: the venv hides the difference from everything below. The user's uid and gid, 10001, are the ones
# the Kubernetes manifests run as.
RUN set -eu; \
    python3 -m venv /opt/venv; \
    groupadd --gid 10001 dflash; \
    useradd --uid 10001 --gid 10001 --home-dir /home/dflash --create-home --shell /usr/sbin/nologin dflash
