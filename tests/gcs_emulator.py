"""gcp-storage-emulator with GCS's `objects.move` API (`POST .../b/B/o/SRC/moveTo/o/DST`), which it lacks.

gcsfs (2026.10.1 here) moves an object with that one call and, answered 501 by the emulator, retries it for about 34 s
before it falls back to a copy and a delete: every `fs.mv` in a test cost half a minute. Here a move is what GCS
documents it to be, within one bucket: the object under its new name (copied whole, checksums and all), the old name
gone. Run as the emulator's own command line: `python tests/gcs_emulator.py start --host ... --port ...`."""
import sys
from http import HTTPStatus
from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.exceptions import Conflict, NotFound
from gcp_storage_emulator.handlers import objects


def move(request, response, storage, *args, **kwargs):
    p = request.params
    try:
        moved = objects._copy(request.base_url, storage, p["bucket_name"], p["object_id"], p["bucket_name"], p["dest_object_id"])
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    except Conflict as e:
        objects._handle_conflict(response, e)
        return
    objects._delete(storage, p["bucket_name"], p["object_id"])
    response.json(moved)


ROUTES = tuple((rf"^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$",
                {server.POST: move}) for prefix in (server.settings.API_ENDPOINT, ""))
server.HANDLERS = ROUTES + server.HANDLERS   # before the generic object route, which would take it for an object name

if __name__ == "__main__": main(sys.argv[1:])
