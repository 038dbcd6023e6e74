# The dependency layer of an image with local wheel sources (wheels.Dockerfile): the marker's lock= is the lock
# file to install (COPYed just above), check= the command that checks the installed set. Copied into
# docker/*/Dockerfile by scripts/render_dockerfiles.py (`make dockerfiles`); this header, up to the first blank
# line, is not copied.

# Dependency layer: changes only with the lock, so source edits rebuild in seconds. The CA bundle of a
# TLS-intercepting proxy (build secret "cacert") and the wheel folders are mounted for this step only
# and never stored in a layer. Among equally ranked links to the same file pip's resolver tries the one
# from the index named last first: the local indexes, added after the default one, win. Everything is
# hash-pinned and installed without resolution (--no-deps): what is installed is exactly the lock.
RUN --mount=type=secret,id=cacert \
    --mount=type=bind,from=wheels,target=/opt/wheels/a \
    --mount=type=bind,from=wheels-extra,target=/opt/wheels/b \
    set -eu; \
    if [ -s /run/secrets/cacert ]; then export PIP_CERT=/run/secrets/cacert; fi; \
    set --; \
    for root in /opt/wheels/a /opt/wheels/b; do \
        if [ -d "$root/simple" ]; then set -- "$@" --extra-index-url "file://$root/simple"; fi; \
        if ls "$root"/*.whl >/dev/null 2>&1; then set -- "$@" --find-links "$root"; fi; \
    done; \
    echo "local wheel sources: ${*:-none}"; \
    pip install --no-cache-dir --require-hashes --no-deps "$@" -r {{lock}}; \
    {{check}}
