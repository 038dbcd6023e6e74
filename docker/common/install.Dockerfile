# The source layer's install step: every project package COPYed under /opt/dflash/src just above it. The
# marker's check= is the command that checks the installed set (`pip check`, or an image's own wrapper).
# Copied into docker/*/Dockerfile by scripts/render_dockerfiles.py (`make dockerfiles`); this header, up to the
# first blank line, is not copied.

# Every package copied under /opt/dflash/src, without resolution or build isolation: the lock installed above
# holds their dependencies and the setuptools that builds them. Build leftovers do not stay in the layer.
RUN set -eu; \
    pip install --no-cache-dir --no-deps --no-build-isolation /opt/dflash/src/*; \
    rm -rf /opt/dflash/src/*/build /opt/dflash/src/*/src/*.egg-info; \
    {{check}}
