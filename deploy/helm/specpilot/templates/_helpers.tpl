{{- define "specpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specpilot.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "specpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specpilot.tokenSecret" -}}
{{- .Values.policyToken.existingSecret | default (printf "%s-token" (include "specpilot.fullname" .)) -}}
{{- end -}}

{{/* The checks no schema can express; each names the value to change. */}}
{{- define "specpilot.checks" -}}
{{- if and .Values.sidecar.native (not (semverCompare ">=1.29.0-0" .Capabilities.KubeVersion.Version)) -}}
{{- fail (printf "sidecar.native=true needs Kubernetes >= 1.29 (native sidecars); this cluster is %s: set sidecar.native=false" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if and .Values.redis.enabled (not (or .Values.redis.url .Values.redis.existingSecret)) -}}
{{- fail "redis.enabled=true needs redis.url or redis.existingSecret" -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled -}}
{{- fail "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true: enable one (each would scrape the controller)" -}}
{{- end -}}
{{- end -}}

{{- define "specpilot.controllerContainer" -}}
- name: specpilot
  image: "{{ .Values.controller.image.repository }}:{{ .Values.controller.image.tag }}"
  imagePullPolicy: {{ .Values.controller.image.pullPolicy }}
  {{- if .Values.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  args: ["serve", "--config", "/etc/specpilot/specpilot.yaml", "--log-level", {{ .Values.controller.logLevel | quote }}]
  env:
    - name: SPECPILOT_POLICY_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "specpilot.tokenSecret" . }}
          key: {{ .Values.policyToken.key }}
    - name: SPECPILOT_ENGINE_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "specpilot.tokenSecret" . }}
          key: {{ .Values.policyToken.engineKey }}
    - name: SPECPILOT_SIDECAR_ID
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    {{- if .Values.redis.enabled }}
    - name: SPECPILOT_STATE_STORE
      {{- if .Values.redis.existingSecret }}
      valueFrom:
        secretKeyRef:
          name: {{ .Values.redis.existingSecret }}
          key: {{ .Values.redis.existingSecretKey }}
      {{- else }}
      value: {{ .Values.redis.url | quote }}
      {{- end }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ .Values.controller.grpcPort }}
    - name: http-metrics
      containerPort: {{ .Values.controller.httpPort }}
  startupProbe:
    grpc: {port: {{ .Values.controller.grpcPort }}}
    periodSeconds: 2
    failureThreshold: 30
  livenessProbe:
    grpc: {port: {{ .Values.controller.grpcPort }}}
    periodSeconds: 10
    failureThreshold: 3
  readinessProbe:
    grpc: {port: {{ .Values.controller.grpcPort }}}
    periodSeconds: 5
  resources:
    {{- toYaml .Values.controller.resources | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL]}
  volumeMounts:
    - name: specpilot-config
      mountPath: /etc/specpilot
      readOnly: true
{{- end -}}
