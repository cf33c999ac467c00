// Which containers recovery cannot reach, from a kubelet PodList (the pure part of
// PropagationWatch; the Events it posts are checked end to end in recovery_e2e_test).
#include "agent/kubelet/propagation_watch.h"

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

// A pod mounting an inline CSI volume of ours ("data"), one of another driver ("other") and a
// claim ("claimed"), in containers with various propagation.
constexpr char kPods[] = R"({"kind":"PodList","items":[
  {"metadata":{"namespace":"default","name":"web","uid":"pod-w"},
   "spec":{"volumes":[{"name":"data","csi":{"driver":"fusekeeper.csi"}},
                      {"name":"claimed","persistentVolumeClaim":{"claimName":"my-claim"}},
                      {"name":"other","csi":{"driver":"other.csi"}},
                      {"name":"scratch","emptyDir":{}}],
           "initContainers":[{"name":"fuse-server","restartPolicy":"Always",
                              "volumeMounts":[{"name":"scratch","mountPath":"/s"}]}],
           "containers":[{"name":"app","volumeMounts":[{"name":"data","mountPath":"/d"},
                                                        {"name":"claimed","mountPath":"/c"}]},
                         {"name":"good","volumeMounts":[{"name":"data","mountPath":"/d","mountPropagation":"HostToContainer"},
                                                         {"name":"claimed","mountPath":"/c","mountPropagation":"Bidirectional"}]},
                         {"name":"elsewhere","volumeMounts":[{"name":"other","mountPath":"/o"}]}]}},
  {"metadata":{"namespace":"default","name":"going","uid":"pod-t","deletionTimestamp":"2026-11-23T00:00:00Z"},
   "spec":{"volumes":[{"name":"data","csi":{"driver":"fusekeeper.csi"}}],
           "containers":[{"name":"app","volumeMounts":[{"name":"data","mountPath":"/d"}]}]}},
  {"metadata":{"namespace":"default","name":"stranger","uid":"pod-s"},
   "spec":{"volumes":[{"name":"data","csi":{"driver":"fusekeeper.csi"}}],
           "containers":[{"name":"app","volumeMounts":[{"name":"data","mountPath":"/d"}]}]}}]})";

TEST(PropagationWatchTest, PodListCarriesVolumesMountsAndDeletion) {
  auto pods = ParsePodList(kPods);
  ASSERT_TRUE(pods.ok()) << pods.status();
  ASSERT_EQ(pods->size(), 3u);
  const PodStatus& web = (*pods)[0];
  EXPECT_FALSE(web.terminating);
  EXPECT_TRUE((*pods)[1].terminating);
  ASSERT_EQ(web.volumes.size(), 4u);
  EXPECT_EQ(web.volumes[0].csi_driver, "fusekeeper.csi");
  EXPECT_EQ(web.volumes[1].claim_name, "my-claim");
  ASSERT_EQ(web.mounts.size(), 6u);
  EXPECT_EQ(web.mounts[5].container, "fuse-server") << "init containers (native sidecars) count too";
  EXPECT_EQ(web.mounts[2].propagation, "HostToContainer");
}

TEST(PropagationWatchTest, NamesContainersWithoutPropagationOnlyForVolumesWePublishedIntoThatPod) {
  auto pods = ParsePodList(kPods);
  ASSERT_TRUE(pods.ok());
  // We published "data" into web, and the PV "pv-9" (the claim's) too; stranger is not ours
  // (nothing published into it), going is terminating.
  const std::map<std::string, std::set<std::string>> published = {
      {"pod-w", {"data", "pv-9"}}, {"pod-t", {"data"}}};
  std::set<std::string> unresolved, waiting;
  auto found = FindUnreachableContainers(*pods, "fusekeeper.csi", published, {}, &unresolved, &waiting);
  ASSERT_EQ(found.size(), 1u) << "the claim is not resolved yet";
  EXPECT_EQ(found[0].container, "app");
  EXPECT_EQ(found[0].volume, "data");
  EXPECT_EQ(found[0].propagation, "None");
  EXPECT_EQ(unresolved, std::set<std::string>{"default/my-claim"});
  EXPECT_EQ(waiting, std::set<std::string>{"pod-w"});
  // Resolved to our PV: the claim's mount is named too.
  found = FindUnreachableContainers(*pods, "fusekeeper.csi", published, {{"default/my-claim", "pv-9"}}, &unresolved,
                                    &waiting);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[1].container, "app");
  EXPECT_EQ(found[1].volume, "claimed");
  // Bound to somebody else's PV: not ours.
  found = FindUnreachableContainers(*pods, "fusekeeper.csi", published, {{"default/my-claim", "pv-x"}}, nullptr,
                                    nullptr);
  EXPECT_EQ(found.size(), 1u);
  // Another driver's name: nothing of ours.
  EXPECT_TRUE(FindUnreachableContainers(*pods, "another.csi", published, {{"default/my-claim", "pv-x"}}, nullptr,
                                        nullptr)
                  .empty());
}

}  // namespace
}  // namespace fusekeeper
