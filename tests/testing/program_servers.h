// The servers some FUSE programs talk to, as the e2e tests and programs_bench run them: an sshd
// for sshfs and an S3 endpoint (s3rver) for s3fs, on 127.0.0.1. In every string $W is the work
// directory (its src/ the store sshfs serves), $PORT the server's port and $S3RVER kS3rver; the
// programs run as uid 65534 (nobody).
#pragma once

namespace fusekeeper {

// The S3 endpoint s3fs talks to: s3rver (npm), installed by scripts/setup.sh.
inline constexpr char kS3rver[] = "/opt/fusekeeper-test-tools/node_modules/.bin/s3rver";

// sshfs's server: an sshd of its own on 127.0.0.1:$PORT that lets uid 65534 (nobody) in with a
// key, for SFTP only.
inline constexpr char kSshdSetup[] =
    "mkdir -p /run/sshd && ssh-keygen -q -t ed25519 -N '' -f $W/hostkey && ssh-keygen -q -t ed25519 -N '' -f $W/userkey"
    " && cp $W/userkey.pub $W/authorized_keys && printf '%s\\n' 'ListenAddress 127.0.0.1' 'Port $PORT'"
    " 'HostKey $W/hostkey' 'AuthorizedKeysFile $W/authorized_keys' 'UsePAM no'"
    " 'StrictModes no' 'PasswordAuthentication no' 'AllowUsers nobody' 'Subsystem sftp internal-sftp'"
    " 'ForceCommand internal-sftp' > $W/sshd_config";
inline constexpr char kSshd[] = "exec /usr/sbin/sshd -D -e -f $W/sshd_config";
inline constexpr char kSshdReady[] = "Server listening on";
#define SSHFS_ARGS                                                                                                 \
  "sshfs", "-o", "IdentityFile=$W/userkey,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,port=$PORT", \
      "nobody@127.0.0.1:$W/src", "{mountpoint}"

// s3fs: its credentials, the bucket "demo" on s3rver (kept in $W/s3data).
inline constexpr char kS3fsSetup[] = "echo S3RVER:S3RVER > $W/passwd && chmod 600 $W/passwd && mkdir $W/s3data";
inline constexpr char kS3fsOptions[] = "url=http://127.0.0.1:$PORT,use_path_request_style,passwd_file=$W/passwd";
inline constexpr char kS3rverServer[] =
    "exec $S3RVER -d $W/s3data -a 127.0.0.1 -p $PORT --configure-bucket demo 1>&2";
inline constexpr char kS3rverReady[] = "S3rver listening";

}  // namespace fusekeeper
