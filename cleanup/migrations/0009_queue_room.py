# RoomClaim is now QueueRoom ("claim" means only a sweep's claim of a hold). The table keeps
# its name, so this migration changes Django's state only and runs no SQL.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('cleanup', '0008_room_claim'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RenameModel(old_name='RoomClaim', new_name='QueueRoom'),
                migrations.AlterModelTable(name='queueroom', table='cleanup_roomclaim'),
            ],
            database_operations=[],
        ),
    ]
