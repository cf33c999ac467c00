#!/usr/bin/env python3
"""Makes s3rver's PUT atomic, as S3's is: the body goes to a temporary file that replaces the
object only once all of it (its Content-Length) has arrived. s3rver 3.7.1 writes the object in
place, so a client killed in the middle of an upload (s3fs, killed -9 by the restart tests) left
the object cut short or mixed, and the tests counted s3rver's damage as the relay's. Idempotent.
Usage: s3rver-atomic-put.py <s3rver's lib/stores/filesystem.js>"""
import sys

MARK = "fusekeeper: atomic PUT"
path = sys.argv[1]
src = open(path).read()
if MARK in src:
    sys.exit(0)
start_text = "    const [size, md5] = await new Promise((resolve, reject) => {\n      const writeStream = fs.createWriteStream(objectPath);"
end_text = "    await this.putMetadata(object.bucket, object.key, object.metadata, md5);"
if start_text not in src or end_text not in src:
    print("setup: s3rver's putObject is not the one s3rver 3.7.1 has; its PUT stays non-atomic "
          "(the s3fs restart tests may then read objects an upload cut short)", file=sys.stderr)
    sys.exit(0)
old_start = src.index(start_text)
old_end = src.index(end_text, old_start)
new = """    // """ + MARK + """ (scripts/s3rver-atomic-put.py)
    const partial = objectPath + '.fk-partial-' + process.pid + '-' + Date.now() + '-' + Math.random();
    const expected = object.metadata['content-length'];
    const [size, md5] = await new Promise((resolve, reject) => {
      const writeStream = fs.createWriteStream(partial);
      const md5Context = crypto.createHash('md5');
      let totalLength = 0;
      writeStream
        .on('error', reject)
        .on('finish', () => resolve([totalLength, md5Context.digest('hex')]));
      if (Buffer.isBuffer(object.content)) {
        totalLength = object.content.length;
        md5Context.update(object.content);
        writeStream.end(object.content);
      } else {
        object.content.on('aborted', () => reject(new Error('request aborted')));
        object.content
          .pipe(
            new Transform({
              transform(chunk, encoding, callback) {
                md5Context.update(chunk, encoding);
                totalLength += chunk.length;
                callback(null, chunk);
              },
            }),
          )
          .on('error', reject)
          .pipe(writeStream);
      }
    }).catch(async (err) => {
      await fs.remove(partial).catch(() => {});
      throw err;
    });
    if (expected !== undefined && Number(expected) !== size) {
      await fs.remove(partial).catch(() => {});
      throw new Error('incomplete body: ' + size + ' of ' + expected + ' bytes');
    }
    await fs.rename(partial, objectPath);
"""
src = src[:old_start] + new + src[old_end:]
open(path, "w").write(src)
