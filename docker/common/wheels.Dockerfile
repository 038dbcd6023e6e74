# The build contexts "wheels" and "wheels-extra" of the images whose locks hold the CUDA wheels (several GB): local
# package indexes that docker/build-images.sh passes where a machine keeps them (see locked-deps.Dockerfile). Goes
# between the base-image ARG and the image's FROM. Copied into docker/*/Dockerfile by scripts/render_dockerfiles.py
# (`make dockerfiles`); this header, up to the first blank line, is not copied.

# Empty stand-ins for the wheel-folder build contexts: a build that passes none sees empty folders.
FROM scratch AS wheels
FROM scratch AS wheels-extra
