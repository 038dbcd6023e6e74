# The base image every image builds on, pinned once for all of them. Copied into docker/*/Dockerfile by
# scripts/render_dockerfiles.py (`make dockerfiles`); this header, up to the first blank line, is not copied.

# The default base is the official Python 3.11 slim image on Debian bookworm, pinned by the digest of its
# multi-arch index as published for that tag; refresh it with
#   skopeo inspect --format '{{.Digest}}' docker://python:3.11-slim-bookworm
# Where no registry is reachable, build-images.sh passes a local debootstrap image of the same Debian release
# and Python minor (docker/base/make-local-base.sh) as BASE_IMAGE instead.
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91
