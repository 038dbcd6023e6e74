# The working directory of a stage image: /work, with the scratch folder the non-root user writes to, and the
# user's home for the libraries that cache there. Copied into docker/*/Dockerfile by
# scripts/render_dockerfiles.py (`make dockerfiles`); this header, up to the first blank line, is not copied.

WORKDIR /work
RUN set -eu; mkdir -p /work/scratch; chown -R 10001:10001 /work
ENV HOME=/home/dflash \
    HF_HOME=/home/dflash/.cache/huggingface \
    TMPDIR=/work/scratch
