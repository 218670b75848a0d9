"""The test-only injector's forced overflow (``KVPLANE_TEST_FORCE_OVERFLOW_FILE``, loaded by this
directory's ``sitecustomize``): while the flag file exists the staging room has no room, so every
step that stages is served at rest (``LayeredKVCore.overflow``), the path a batch whose staging
exceeds the device takes."""

from __future__ import annotations

import os

TARGET = "sglang_ext.dataplane.staging_room"


def patch(module) -> None:  # noqa: ANN001
    """While the flag exists the staging room has no room: every step that stages is served at
    rest (``LayeredKVCore.overflow``), the path a batch whose staging exceeds the device takes."""
    flag = os.environ["KVPLANE_TEST_FORCE_OVERFLOW_FILE"]
    room = module.StagingRoom
    real_take, real_renew, real_make_room_for = room.take, room.renew, room.make_room_for

    def take(self, n):  # noqa: ANN001, ANN202
        if n > 0 and os.path.exists(flag):
            self.wanted = n
            return None
        return real_take(self, n)

    def renew(self, ids, extra):  # noqa: ANN001, ANN202
        if ids.size + extra > 0 and os.path.exists(flag):
            self.wanted = int(ids.size) + extra
            return 0, None
        return real_renew(self, ids, extra)

    def make_room_for(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return False if os.path.exists(flag) else real_make_room_for(self, *args, **kwargs)

    room.take, room.renew, room.make_room_for = take, renew, make_room_for
