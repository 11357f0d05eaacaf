# The ascend_pool image: the package installed the way the README does (pip install .), with the
# C compiler the extension's build needs (and g++ for the torch allocators' throwing alloc), running as a non-root user. On an NPU node, mount the
# CANN runtime (or use a CANN base image) and set ASCEND_POOL_ACL_LIB / ASCEND_HOME_PATH; without it
# the package runs on its simulated NPU. Deployment: deploy/ (a kustomize base).
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && groupadd --gid 2000 ascend-pool \
 && useradd --uid 2000 --gid 2000 --no-create-home --shell /usr/sbin/nologin ascend-pool
USER 2000:2000
EXPOSE 9464
ENTRYPOINT ["ascend-pool"]
CMD ["serve", "--host=0.0.0.0"]
