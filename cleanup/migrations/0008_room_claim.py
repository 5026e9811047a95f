# The queue-room table is named for what it holds: room under the release queue's cap that a
# sweep claimed (cleanup.models.RoomClaim; its table becomes cleanup_roomclaim).

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('cleanup', '0007_release_pause'),
    ]

    operations = [
        migrations.RenameModel(old_name='PublishReservation', new_name='RoomClaim'),
    ]
