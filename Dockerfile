# One image for every process of the system (web, worker, beat, flower, migrate): the compose
# file (or the Kubernetes manifests in deploy/k8s/) picks the command. Runtime requirements only;
# runs as an unprivileged user.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=config.settings.production \
    STATIC_ROOT=/app/var/static

WORKDIR /app
RUN useradd --create-home --uid 10001 app

# The runtime lock: every package pinned with its hashes (compiled from requirements.in).
COPY requirements.txt ./
RUN pip install --require-hashes -r requirements.txt

COPY . .
# Static files (the admin's) are collected into the image, compressed, and served by WhiteNoise
# from the app server. collectstatic reads no secret and touches no database; the local
# settings module gives it the placeholders it needs at build time only.
RUN DJANGO_SETTINGS_MODULE=config.settings.local DEBUG=false \
    python manage.py collectstatic --noinput \
 && mkdir -p /app/var/flower /app/var/prometheus \
 && chown -R app:app /app/var

USER app
EXPOSE 8000 5555 9808
CMD ["gunicorn", "config.wsgi:application", "--bind=0.0.0.0:8000", "--workers=3", "--timeout=30", "--access-logfile=-"]
