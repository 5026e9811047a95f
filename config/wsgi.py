import os

from django.core.wsgi import get_wsgi_application

# Without the variable, production: it refuses to start without real secrets, where a
# development default would run with DEBUG and public keys.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
application = get_wsgi_application()
