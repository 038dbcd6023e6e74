# The last steps of every image: the build's record, the common labels, the provenance variables and the switch
# to the non-root user. The image's title is dflash-<its folder under docker/>. Copied into docker/*/Dockerfile
# by scripts/render_dockerfiles.py (`make dockerfiles`); this header, up to the first blank line, is not copied.

# The build's record last: the revision changes every commit and must not invalidate the layers above.
ARG GIT_REVISION=unknown
ARG SOURCE_URL=unknown
ARG IMAGE_REF=localhost/dflash-{{name}}
# Some builders (buildah 1.28, podman 4.3) reuse a cached LABEL or ENV step although the build arguments in it
# changed, which would leave an old revision in the labels and manifests. A RUN step's cache key holds the
# argument values, so this record of the build keeps every step after it current.
RUN printf 'revision=%s\nimage=%s\nsource=%s\n' "$GIT_REVISION" "$IMAGE_REF" "$SOURCE_URL" > /opt/dflash/build-info
LABEL org.opencontainers.image.title="dflash-{{name}}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.revision="${GIT_REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# The image's revision and reference, which dflash_shared.provenance records in every manifest a stage writes.
ENV DFLASH_GIT_REVISION=${GIT_REVISION} \
    DFLASH_IMAGE=${IMAGE_REF}
USER 10001:10001
