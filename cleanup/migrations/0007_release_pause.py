# The "pause releases" switch (cleanup.models.ReleasePause, cleanup.pipeline.pause).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('cleanup', '0006_publish_reservation'),
    ]

    operations = [
        migrations.CreateModel(
            name='ReleasePause',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('paused', models.BooleanField(default=False)),
                ('since', models.DateTimeField(blank=True, null=True)),
                ('changed_by', models.CharField(blank=True, max_length=150)),
                ('reason', models.CharField(blank=True, max_length=500)),
            ],
            options={
                'verbose_name': 'release pause',
                'verbose_name_plural': 'release pause',
            },
        ),
    ]
