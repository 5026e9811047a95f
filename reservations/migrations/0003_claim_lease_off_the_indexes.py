from django.db import migrations

# The claim's lease (next_attempt_at) leaves every index, so a claim updates no indexed column
# and PostgreSQL can write it as a heap-only (HOT) update, which needs free room on the row's
# page: 30 % of each new page is kept free for it (existing pages keep their layout until they
# are rewritten). reservations.services.claim_expired reads the lease from the row instead.
FILLFACTOR = 70


class Migration(migrations.Migration):
    dependencies = [
        ("reservations", "0002_claim_and_slo_indexes_per_bucket"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="reservation",
            name="reservations_claim_bucket_idx",
        ),
        migrations.RunSQL(
            f"ALTER TABLE reservations_reservation SET (fillfactor = {FILLFACTOR})",
            reverse_sql="ALTER TABLE reservations_reservation RESET (fillfactor)",
        ),
    ]
