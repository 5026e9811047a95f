import os

from django.core.wsgi import get_wsgi_application

from cleanup import tracing

# Without the variable, production: it refuses to start without real secrets, where a
# development default would run with DEBUG and public keys.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
# In each gunicorn worker (the app is loaded after the fork), before Django builds its
# middleware: the Django instrumentation adds its own. Off unless an OTLP endpoint is set.
tracing.configure("web")
application = get_wsgi_application()
