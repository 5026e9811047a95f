# One image for every process of the system (web, worker, beat, flower, migrate): the compose
# file picks the command. Runtime requirements only; runs as an unprivileged user.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=config.settings.production

WORKDIR /app
RUN useradd --create-home --uid 10001 app

COPY requirements.txt ./
RUN pip install -r requirements.txt

COPY . .
RUN mkdir -p /app/var/flower && chown -R app:app /app/var

USER app
EXPOSE 8000 5555
# The dev server (gunicorn is not a pinned requirement yet); --insecure serves the admin's static
# files with DEBUG off. Put a real WSGI server and a static file server in front for production.
CMD ["python", "manage.py", "runserver", "0.0.0.0:8000", "--noreload", "--insecure"]
